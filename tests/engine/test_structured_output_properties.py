"""Property: outputs under random JSON schemas validate with `jsonschema` (default model)."""
from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputsParams as Constraint

ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(kv_cache_memory="48MiB", max_model_len=512, max_num_seqs=8)
    yield engine
    engine.shutdown()


# Bounded values, so that a small model can finish an object within max_tokens.
_SCALARS = st.sampled_from([{"type": "integer", "minimum": -50, "maximum": 999}, {"type": "boolean"},
                            {"type": "string", "maxLength": 8}, {"enum": ["a", "b", 3]}, {"type": "null"},
                            {"type": "string", "pattern": "^[a-z]{1,4}$"}, {"const": "x"}])
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.builds(lambda items: {"type": "array", "items": items, "maxItems": 2}, inner),
    st.builds(lambda props: {"type": "object", "properties": props, "required": sorted(props),
                             "additionalProperties": False},
              st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, min_size=1, max_size=2))),
    max_leaves=4)
_SCHEMAS = st.builds(lambda props: {"type": "object", "properties": props, "required": sorted(props),
                                    "additionalProperties": False},
                     st.dictionaries(st.sampled_from(["id", "name", "tags", "ok"]), _VALUES, min_size=1, max_size=3))


# Generation only: shrinking a failure would rerun the model dozens of times.
@settings(max_examples=3, deadline=None, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schemas=st.lists(_SCHEMAS, min_size=6, max_size=6))
def test_random_schemas_give_valid_json(llm, schemas):
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=120, structured_outputs=Constraint(json=s))
              for i, s in enumerate(schemas)]
    outputs = llm.chat([ASK] * len(schemas), params, use_tqdm=False)
    finished = 0
    for schema, output in zip(schemas, outputs):
        completion = output.outputs[0]
        if completion.finish_reason == "stop":
            finished += 1
            jsonschema.validate(json.loads(completion.text), schema)
    assert finished >= len(schemas) // 2, [o.outputs[0].text for o in outputs]
