"""A vLLM offline script that runs on Cadence with only its import changed
(`from vllm import LLM, SamplingParams` becomes the line below). It uses vLLM's
names for n samples, stop reasons, logprobs with decoded tokens, logit bias,
allowed and bad words, special tokens and prompt truncation.

    python examples/vllm_offline.py
"""

from cadence.actors import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(model="demo", tokenizer="demo", max_model_len=256, seed=0, enforce_eager=True,
              trust_remote_code=False, gpu_memory_utilization=0.5)
    tokenizer = llm.get_tokenizer()

    # n samples of one prompt (best_of equal to n), top_k=-1 for no top-k.
    sampled = llm.generate("def ", SamplingParams(n=3, best_of=3, temperature=1.0, top_k=-1, seed=1,
                                                  max_tokens=12))
    for completion in sampled[0].outputs:
        print("sample", completion.index, repr(completion.text))

    # stop_reason: the stop string matched, or the stop token id.
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
    stopped = llm.generate(["def ", "import "], [
        SamplingParams(temperature=0.0, max_tokens=64, stop=["(", ":"]),
        SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=[newline]),
    ])
    for output in stopped:
        print("stop", repr(output.outputs[0].text), output.outputs[0].finish_reason,
              repr(output.outputs[0].stop_reason))

    # logprobs with each candidate's decoded token.
    scored = llm.generate("class ", SamplingParams(temperature=0.0, max_tokens=4, logprobs=2))
    for position in scored[0].outputs[0].logprobs:
        print("logprobs", {token: (round(lp.logprob, 3), lp.rank, lp.decoded_token)
                           for token, lp in position.items()})

    # logit_bias, allowed_token_ids, bad_words, skip_special_tokens, truncate_prompt_tokens.
    allowed = tokenizer.encode("abc", add_special_tokens=False)
    steered = llm.generate(["x = ", "x = ", "x = ", "a long prompt whose start is cut: x = "], [
        SamplingParams(temperature=0.0, max_tokens=6, logit_bias={allowed[0]: 100.0}),
        SamplingParams(temperature=1.0, seed=2, max_tokens=6, allowed_token_ids=allowed),
        SamplingParams(temperature=0.0, max_tokens=6, bad_words=["None", "self"]),
        SamplingParams(temperature=0.0, max_tokens=6, truncate_prompt_tokens=4,
                       skip_special_tokens=False),
    ])
    for output in steered:
        print("steered", len(output.prompt_token_ids), repr(output.outputs[0].text))
    llm.close()
