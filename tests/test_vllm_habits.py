"""What a vLLM user types works here too, or is refused with a message that says what
to do instead: prompts as vLLM's ``TextPrompt`` dicts, ``minivllm serve MODEL``, the
bundled model's Hub id as the served name, ``--version``, tensor-parallel sizes, and
refusal messages that suggest commands which exist."""

from __future__ import annotations

import pytest

from minivllm import BeamSearchParams, SamplingParams

PROMPTS = ["w1 w2 w3", "w7 w8"]


def test_text_prompt_dicts_equal_plain_text(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = llm.generate(PROMPTS, params, use_tqdm=False)
    dicts = llm.generate([{"prompt": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert [o.prompt for o in dicts] == PROMPTS
    one = llm.generate({"prompt": PROMPTS[0]}, params, use_tqdm=False)
    assert one[0].outputs[0].token_ids == plain[0].outputs[0].token_ids

    beams = BeamSearchParams(beam_width=2, max_tokens=4)
    [want] = llm.beam_search(PROMPTS[0], beams)
    [got] = llm.beam_search({"prompt": PROMPTS[0]}, beams)
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]

    with pytest.raises(ValueError, match="TextPrompt's prompt must be a str"):
        llm.generate({"prompt": 42}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate({"prompt": ""}, params, use_tqdm=False)
