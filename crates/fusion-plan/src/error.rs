use thiserror::Error;

#[derive(Debug, Error)]
pub enum PlanError {
    #[error("{0}")]
    Invalid(String),
    #[error("no plan fits: {0}")]
    Infeasible(String),
    #[error("testbed: {0}")]
    Testbed(#[from] fusion_testbed::TestbedError),
    #[error("simulation: {0}")]
    Sim(#[from] fusion_sim::SimError),
    #[error("{scheduler} cannot plan this instance: {why}")]
    TooLarge {
        scheduler: &'static str,
        why: String,
    },
}
