"""The routing plan all nodes of a job share (`plan_json` of an assignment), checked before use,
and the pipeline schedules."""

import json

from .errors import ProtocolError


def _int(v, what):
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ProtocolError(f"plan: {what} must be a non-negative integer, got {v!r}")
    return v


class Plan:
    def __init__(self, text, stage):
        try:
            p = json.loads(text)
            if not isinstance(p, dict):
                raise ProtocolError("plan: not a JSON object")
            self.assignment = [_int(s, "a stage") for s in p["assignment"]]
            self.stage_nodes = [str(n) for n in p["stage_nodes"]]
            self.stage_params = [[_int(i, "a parameter id") for i in ps] for ps in p["stage_params"]]
            self.stages = [self._routes(r) for r in p["stages"]]
            self.recompute = [_int(r, "a segment count") for r in p.get("recompute", [])]
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
            raise ProtocolError(f"plan: missing or malformed field ({e})") from None
        n = len(self.stages)
        if len(self.stage_nodes) != n or len(self.stage_params) != n or not 0 <= stage < n:
            raise ProtocolError(f"plan: stage {stage} of a plan with {n} stages, {len(self.stage_nodes)} nodes")
        for r in self.stages:
            for i in r["inputs"]:
                if i["source"] is not None and i["source"] >= n:
                    raise ProtocolError(f"plan: an input from stage {i['source']} of {n}")
            for o in r["outputs"]:
                if any(c >= n for c in o["consumers"]):
                    raise ProtocolError(f"plan: an output read by a stage beyond the {n}")
            for s in r["shared"]:
                if any(x >= n for x in s["stages"]):
                    raise ProtocolError(f"plan: a shared parameter held by a stage beyond the {n}")
        self.num_stages = n

    @staticmethod
    def _routes(r):
        def source(s):
            if s == "data":
                return None
            if isinstance(s, dict) and "stage" in s:
                return _int(s["stage"], "a source stage")
            raise ProtocolError(f"plan: unknown input source {s!r}")

        return {
            "inputs": [{"tensor": _int(i["tensor"], "a tensor id"), "source": source(i["source"])}
                       for i in r["inputs"]],
            "outputs": [{"tensor": _int(o["tensor"], "a tensor id"),
                         "consumers": [_int(c, "a consumer") for c in o["consumers"]],
                         "graph_output": o.get("graph_output")} for o in r["outputs"]],
            "shared": [{"param": _int(s["param"], "a parameter id"),
                        "stages": [_int(x, "a stage") for x in s["stages"]]}
                       for s in r.get("shared", [])],
        }

    def senders_to(self, stage):
        """Stages that send this stage anything: activations in, gradients of its outputs back,
        parts of shared parameters' gradients."""
        r = self.stages[stage]
        s = {i["source"] for i in r["inputs"] if i["source"] is not None}
        for o in r["outputs"]:
            s.update(o["consumers"])
        for sp in r["shared"]:
            s.update(x for x in sp["stages"] if x != stage)
        s.discard(stage)
        return sorted(s)


def passes(schedule, stage, stages, m):
    """(kind, micro-batch) in the order stage `stage` of `stages` runs them: GPipe (all forwards,
    then all backwards) or 1F1B (warm-up forwards, one forward / one backward, the rest)."""
    if schedule == "gpipe":
        return [("f", i) for i in range(m)] + [("b", i) for i in range(m)]
    warm = min(stages - stage - 1, m)
    order = [("f", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("f", warm + i), ("b", i)]
    return order + [("b", i) for i in range(m - warm, m)]
