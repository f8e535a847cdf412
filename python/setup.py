"""Builds the package after generating the protocol stubs from the repository's proto/ files.

The stubs are not checked in: `pip install ./python` runs grpcio-tools on `../proto/*.proto`
(or on the directory named by FUSIONLLM_PROTO_DIR), so the Python node always speaks the protocol
of the tree it is installed from.
"""

import os
import re
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fusionllm_node", "wire")
PROTOS = ("fusionllm.proto", "fusionllm_control.proto")


def proto_dir():
    given = os.environ.get("FUSIONLLM_PROTO_DIR")
    d = given or os.path.join(HERE, "..", "proto")
    if not all(os.path.isfile(os.path.join(d, p)) for p in PROTOS):
        sys.exit(
            f"fusionllm-node: the protocol files {PROTOS} are not in {d}; install from the "
            "repository (pip install ./python) or set FUSIONLLM_PROTO_DIR"
        )
    return d


def generate():
    from grpc_tools import protoc  # a build requirement (pyproject.toml)
    import grpc_tools

    src = proto_dir()
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    for p in PROTOS:
        code = protoc.main(
            ["protoc", f"-I{src}", f"-I{include}", f"--python_out={OUT}",
             f"--grpc_python_out={OUT}", os.path.join(src, p)]
        )
        if code != 0:
            sys.exit(f"fusionllm-node: protoc failed on {p} (exit {code})")
    # The generated modules import each other as top-level modules; make them package-relative.
    for name in os.listdir(OUT):
        if name.endswith("_pb2.py") or name.endswith("_pb2_grpc.py"):
            path = os.path.join(OUT, name)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            text = re.sub(r"^import (fusionllm\w*_pb2) as", r"from . import \1 as", text, flags=re.M)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)


class BuildWithStubs(build_py):
    def run(self):
        generate()
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
