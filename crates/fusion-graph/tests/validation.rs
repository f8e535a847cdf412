//! Validation rejects malformed graphs with errors naming the problem.

use fusion_graph::{DType, Graph, GraphBuilder, GraphError, Op, TensorId};

fn mlp() -> Graph {
    let mut b = GraphBuilder::new("mlp");
    let x = b.input("x", vec![4, 8], DType::F32);
    let y = b.input("y", vec![4], DType::I32);
    let h = b.linear("fc1", x, 16, true).unwrap();
    let h = b.op("act", Op::Relu, &[h], None).unwrap();
    let logits = b.linear("fc2", h, 3, true).unwrap();
    let loss = b
        .op("loss", Op::SoftmaxCrossEntropy, &[logits, y], None)
        .unwrap();
    b.output(loss);
    b.finish().unwrap()
}

#[test]
fn valid_graph_round_trips_through_json() {
    let g = mlp();
    let text = g.to_json();
    let back = Graph::from_json(&text).unwrap();
    assert_eq!(g, back);
    assert_eq!(g.num_trainable(), 8 * 16 + 16 + 16 * 3 + 3);
}

#[test]
fn cycle_is_rejected() {
    let mut g = mlp();
    // Make fc1 read the output of act, which reads fc1: a cycle.
    let act_out = g.nodes[1].outputs[0];
    g.nodes[0].inputs[0] = act_out;
    let err = g.validate().unwrap_err();
    assert!(matches!(err, GraphError::Cycle(_)), "{err}");
}

#[test]
fn dangling_edge_is_rejected() {
    let mut g = mlp();
    g.nodes[1].inputs[0] = TensorId(999);
    let err = g.validate().unwrap_err();
    assert!(err.to_string().contains("act"), "{err}");
    assert!(matches!(err, GraphError::DanglingTensor { .. }));
}

#[test]
fn shape_mismatch_is_rejected() {
    let mut g = mlp();
    let out = g.nodes[0].outputs[0];
    g.tensors[out.0].shape = vec![4, 17];
    let err = g.validate().unwrap_err();
    assert!(
        err.to_string().contains("fc1") || err.to_string().contains("act"),
        "{err}"
    );
}

#[test]
fn wrong_param_shape_is_rejected() {
    let mut g = mlp();
    g.params[0].shape = vec![16, 9];
    let err = g.validate().unwrap_err();
    assert!(matches!(err, GraphError::ParamShape { .. }), "{err}");
}

#[test]
fn unknown_op_and_bad_version_are_rejected() {
    let text = mlp().to_json().replace("\"relu\"", "\"frobnicate\"");
    let err = Graph::from_json(&text).unwrap_err();
    assert!(err.to_string().contains("frobnicate"), "{err}");
    let text = mlp().to_json().replace("\"version\": 1", "\"version\": 99");
    let err = Graph::from_json(&text).unwrap_err();
    assert!(matches!(err, GraphError::Version { .. }), "{err}");
}

#[test]
fn builder_reports_bad_shapes_at_the_call() {
    let mut b = GraphBuilder::new("bad");
    let x = b.input("x", vec![2, 3], DType::F32);
    let y = b.input("y", vec![2, 4], DType::F32);
    let err = b.op("sum", Op::Add, &[x, y], None).unwrap_err();
    assert!(err.to_string().contains("sum"), "{err}");
}

#[test]
fn absurd_shapes_are_rejected_without_overflow() {
    let mut g = mlp();
    g.tensors[0].shape = vec![usize::MAX, 2];
    assert!(matches!(
        g.validate().unwrap_err(),
        GraphError::TooLarge { .. }
    ));
    let mut g = mlp();
    g.params[0].shape = vec![1 << 30, 1 << 30];
    assert!(matches!(
        g.validate().unwrap_err(),
        GraphError::TooLarge { .. }
    ));
}
