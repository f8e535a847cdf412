"""Benchmark: one job on four kinds of nodes (Rust candle, Rust reference, Python NumPy, Python
PyTorch), against the same job in one process. Prints a table of step time per node and the
largest loss difference, and writes JSON.

    python -m venv bench-env && bench-env/bin/pip install ./python torch
    cargo build --release --bin fusionllm
    bench-env/bin/python python/bench/mixed_job.py --out docs/results/python-node.json

Each node is a separate process on this machine; the broker places one pipeline stage on each
(even cuts) and every node's compute and wait seconds per step come from its report.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TOKEN = "bench-token-0123456789abcdef"


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fusionllm", default=os.path.join(ROOT, "target", "release", "fusionllm"))
    p.add_argument("--python", default=sys.executable, help="interpreter with fusionllm_node and torch")
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--nodes", default="candle,reference,numpy,torch",
                   help="backend of each node, in stage order (candle, reference, numpy, torch)")
    p.add_argument("--single-backend", default="reference", help="backend of the one-process run")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args()


def job_file(a, d):
    path = os.path.join(d, "job.toml")
    with open(path, "w") as f:
        f.write(f'model = "{a.model}"\nnodes = {len(a.nodes.split(","))}\nschedule = "1f1b"\n'
                f'scheduler = "even"\nprobe_links = true\n[train]\nsteps = {a.steps}\n'
                f"batch_size = {a.batch}\nseq_len = {a.seq}\nmicro_batches = {a.micro_batches}\n"
                f"eval_every = 0\neval_batches = 1\n")
    return path


def start_nodes(a, d, url):
    procs = []
    for i, kind in enumerate(a.nodes.split(",")):
        name = f"node{i}"
        log = open(os.path.join(d, f"{name}.log"), "w")
        common = ["--broker", url, "--name", name, "--certs", os.path.join(d, "certs"),
                  "--token", TOKEN, "--data-listen", "127.0.0.1:0"]
        if kind in ("candle", "reference"):
            cmd = [a.fusionllm, "node", "--backend", kind] + common
        elif kind in ("numpy", "torch"):
            cmd = [a.python, "-m", "fusionllm_node", "--backend", kind] + common
        else:
            sys.exit(f"unknown node kind '{kind}'")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        time.sleep(0.3)  # join in stage order, so the table's nodes line up with the kinds
    return procs


def run_mixed(a, d):
    names = ",".join(["broker"] + [f"node{i}" for i in range(len(a.nodes.split(",")))])
    subprocess.run([a.fusionllm, "cert", "--out", os.path.join(d, "certs"), "--names", names],
                   check=True, capture_output=True)
    port = 7300 + os.getpid() % 500
    url = f"https://127.0.0.1:{port}"
    report = os.path.join(d, "mixed.json")
    broker = subprocess.Popen(
        [a.fusionllm, "broker", "--job", job_file(a, d), "--listen", f"127.0.0.1:{port}",
         "--certs", os.path.join(d, "certs"), "--token", TOKEN, "--report", report],
        stdout=open(os.path.join(d, "broker.log"), "w"), stderr=subprocess.STDOUT, cwd=ROOT)
    time.sleep(1.0)
    nodes = start_nodes(a, d, url)
    t0 = time.time()
    code = broker.wait(timeout=3600)
    wall = time.time() - t0
    for n in nodes:
        try:
            n.wait(timeout=60)
        except subprocess.TimeoutExpired:
            n.kill()
    if code != 0:
        sys.exit(f"the broker failed (exit {code}); see {d}/broker.log")
    with open(report) as f:
        return json.load(f), wall


def run_single(a, d):
    report = os.path.join(d, "single.json")
    subprocess.run([a.fusionllm, "train", "--nodes", "1", "--backend", a.single_backend,
                    "--model", a.model, "--steps", str(a.steps), "--batch", str(a.batch),
                    "--seq", str(a.seq), "--micro-batches", str(a.micro_batches),
                    "--eval-every", "0", "--eval-batches", "1", "--report", report],
                   check=True, capture_output=True, cwd=ROOT)
    with open(report) as f:
        return json.load(f)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def summarise(a, mixed, single, wall):
    by_stage = {p["stage"]: p for p in mixed["placement"]}
    timings = mixed["timings"][1:] or mixed["timings"]  # the first step warms caches up
    rows = []
    for s in sorted(by_stage):
        p = by_stage[s]
        compute = [t["compute_s"][s] for t in timings]
        wait = [t["wait_s"][s] for t in timings]
        rows.append({"stage": s, "node": p["node"], "backend": p["backend"], "operators": p["operators"],
                     "params": p["params"], "compute_s_median": statistics.median(compute),
                     "wait_s_median": statistics.median(wait)})
    pairs = list(zip(single["steps"], mixed["steps"]))
    rel = [abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in pairs]
    return {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        "model": a.model, "steps": a.steps, "batch": a.batch, "seq": a.seq,
        "micro_batches": a.micro_batches, "single_backend": a.single_backend,
        "step_s_median": statistics.median(t["wall_s"] for t in timings), "wall_s": wall,
        "nodes": rows, "max_relative_loss_difference": max(rel), "final_loss_mixed": mixed["steps"][-1]["loss"],
        "final_loss_single": single["steps"][-1]["loss"],
    }


def main():
    a = parse()
    with tempfile.TemporaryDirectory() as d:
        mixed, wall = run_mixed(a, d)
        single = run_single(a, d)
    r = summarise(a, mixed, single, wall)
    print(f"{r['model']}, batch {r['batch']} x seq {r['seq']}, {r['micro_batches']} micro-batches, "
          f"{r['steps']} steps on {r['machine']}")
    print(f"{'stage':>5}  {'node':<6} {'backend':<16} {'ops':>4} {'params':>10} {'compute s':>10} {'wait s':>8}")
    for n in r["nodes"]:
        print(f"{n['stage']:>5}  {n['node']:<6} {n['backend']:<16} {n['operators']:>4} {n['params']:>10} "
              f"{n['compute_s_median']:>10.4f} {n['wait_s_median']:>8.4f}")
    print(f"median step {r['step_s_median']:.3f} s; largest relative loss difference against one "
          f"{r['single_backend']} process: {r['max_relative_loss_difference']:.2e} "
          f"(final {r['final_loss_mixed']:.5f} vs {r['final_loss_single']:.5f})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=2)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
