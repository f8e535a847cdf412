"""Encodes and decodes compressed tensor messages for the Rust cross-implementation test
(crates/fusion-runtime/tests/python_node.rs): `python cross_codec.py DIR` reads DIR/x.bin (f32 LE)
and DIR/cases.json ([{name, codec, values}]); for every case it writes DIR/NAME.py.bin (this
package's encoding of x) and DIR/NAME.decoded.bin (its decoding of DIR/NAME.rust.bin, f32 LE)."""

import json
import os
import sys

import numpy as np

from fusionllm_node.codec import Compressor, decode


def main(d):
    x = np.fromfile(os.path.join(d, "x.bin"), "<f4")
    with open(os.path.join(d, "cases.json")) as f:
        cases = json.load(f)
    for c in cases:
        msg = Compressor(c["codec"], c["values"], 0).compress(x)
        with open(os.path.join(d, c["name"] + ".py.bin"), "wb") as f:
            f.write(msg)
        with open(os.path.join(d, c["name"] + ".rust.bin"), "rb") as f:
            decoded = decode(f.read(), x.size)
        decoded.astype("<f4").tofile(os.path.join(d, c["name"] + ".decoded.bin"))


if __name__ == "__main__":
    main(sys.argv[1])
