#!/usr/bin/env python3
"""Simulated speedup of OP-Fence + AdaTopK on the paper-shaped 48-GPU testbeds: one 48-device
pipeline per testbed and model, planned and simulated by `fusionllm plan` three ways (even split
dense, OP-Fence dense, OP-Fence with AdaTopK in its cost model). Prints a table and writes
docs/results/adatopk-sim.json. Run from the repository root after `cargo build --release`."""
import json
import subprocess
import sys

EXE = "./target/release/fusionllm"
TESTBEDS = ["paper-a", "paper-b", "paper-c", "worldwide"]
MODELS = ["gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "resnet101"]


def step(testbed, model, scheduler, adatopk):
    cmd = [EXE, "plan", "--model", model, "--testbed", f"testbeds/{testbed}.toml",
           "--scheduler", scheduler, "--stages", "48", "--replicas", "1", "--no-compare", "--json"]
    if adatopk:
        cmd.append("--adatopk")
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    return json.loads(out.stdout)["simulation"]["step_s"]


def main():
    rows = []
    print(f"{'testbed':<10} {'model':<12} {'even s':>9} {'opfence s':>10} {'+adatopk s':>11} {'vs even':>8} {'vs opfence':>10}")
    for tb in TESTBEDS:
        for m in MODELS:
            even = step(tb, m, "even", False)
            opf = step(tb, m, "opfence", False)
            ada = step(tb, m, "opfence", True)
            rows.append({"testbed": tb, "model": m, "even_step_s": even, "opfence_step_s": opf,
                         "opfence_adatopk_step_s": ada, "speedup_vs_even": even / ada,
                         "speedup_vs_opfence": opf / ada})
            print(f"{tb:<10} {m:<12} {even:>9.2f} {opf:>10.2f} {ada:>11.2f} {even/ada:>7.2f}x {opf/ada:>9.2f}x")
    json.dump(rows, open("docs/results/adatopk-sim.json", "w"), indent=2)


if __name__ == "__main__":
    main()
