"""KV blocks and prefill rows of ``n`` samples of one prompt, shared or not.

    python benchmarks/parallel_sampling_blocks.py [--n 4] [--output-len 16]

One SmolLM2-135M-Instruct prompt, sampled ``--n`` times (temperature 0.8, seeded) two
ways: one ``SamplingParams(n=N)`` request, whose children share the prompt's full blocks,
and ``N`` separate requests with prefix caching off, each holding its own copy. Prints the
prompt length, the most KV blocks in use at once and the prefill rows the model computed.
"""

from __future__ import annotations

import argparse

from minivllm import LLM, SamplingParams

PROMPT = (
    "PagedAttention stores the keys and values of every request in fixed-size blocks, "
    "like an operating system stores a process's memory in pages. A block table maps "
    "each request's token positions to blocks of the pool, so a request can grow one "
    "block at a time and give every block back the moment it finishes. Write three "
    "short sentences that explain why this lets a server batch more requests at once."
)


def run(llm: LLM, prompts: list, params: list[SamplingParams]) -> tuple[int, int]:
    """(most blocks in use after any step, prefill rows computed) of one generate()."""
    engine = llm.llm_engine
    engine.step_log = []
    llm.generate(prompts, params, use_tqdm=False)
    steps, engine.step_log = engine.step_log, None
    return max(s.num_kv_blocks_used for s in steps), sum(s.num_prefill_tokens for s in steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=16)
    args = parser.parse_args()
    sample = dict(temperature=0.8, max_tokens=args.output_len, ignore_eos=True)
    shared_llm = LLM(enable_prefix_caching=False, num_kv_blocks=256)
    prompt_len = len(shared_llm.get_tokenizer()(PROMPT).input_ids)
    shared = run(shared_llm, [PROMPT], [SamplingParams(n=args.n, seed=0, **sample)])
    separate = run(
        shared_llm,
        [PROMPT] * args.n,
        [SamplingParams(seed=i, **sample) for i in range(args.n)],
    )
    block_size = shared_llm.llm_engine.config.block_size
    print(f"prompt: {prompt_len} tokens, block_size {block_size}, n = {args.n}, "
          f"{args.output_len} output tokens each")  # fmt: skip
    print("| | most KV blocks in use | prefill rows computed |")
    print("| --- | --- | --- |")
    print(f"| one request, n = {args.n} (shared prompt blocks) | {shared[0]} | {shared[1]} |")
    print(f"| {args.n} separate requests (no sharing) | {separate[0]} | {separate[1]} |")


if __name__ == "__main__":
    main()
