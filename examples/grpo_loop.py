"""A GRPO-style loop: a torch policy (the checkpoint in transformers) trained on rollouts that
tandem generates, its new weights pushed into the running engine after every update.

Each step: n samples per prompt with their logprobs from tandem; a reward per sample (here a toy
one: the share of even token ids); advantages normalized within each prompt's group; a
policy-gradient step on the transformers model; `LLM.update_weights(policy.state_dict())`.
The loop checks the engine against itself: the rollout logprobs match the policy's own (to
float32 rounding), and at the end an engine started fresh on the saved weights gives the
updated engine's rollouts bit for bit.

Usage: PYTHONPATH=src python3 examples/grpo_loop.py CHECKPOINT_DIR [--steps 3]
(e.g. a tiny model: python3 -c "from tandem.model.tiny import make_tiny_model; make_tiny_model('/tmp/tiny', 'llama')")
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from tandem import LLM, SamplingParams

PROMPTS = [[5, 17, 30, 9, 11, 12], [40, 41, 3, 8, 22]]
NUM_SAMPLES = 4


def rollout_params(step: int) -> SamplingParams:
    return SamplingParams(n=NUM_SAMPLES, temperature=1.0, seed=100 + step, max_tokens=12,
                          ignore_eos=True, logprobs=0)  # fmt: skip


def rollouts(llm: LLM, step: int) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, completion, the engine's logprob of each completion token) per sample."""
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], rollout_params(step), use_tqdm=False
    )
    samples = []
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        for sample in output.outputs:
            logprobs = [lp[t] for lp, t in zip(sample.logprobs, sample.token_ids, strict=True)]
            samples.append((prompt, sample.token_ids, logprobs))
    return samples


def reward(completion: list[int]) -> float:
    return sum(t % 2 == 0 for t in completion) / len(completion)


def advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Rewards normalized within each prompt's group of samples."""
    groups = rewards.view(len(PROMPTS), NUM_SAMPLES)
    normed = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)
    return normed.flatten()


def policy_logprobs(policy, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """[len(completion)] the policy's log-probabilities of the completion's tokens."""
    ids = torch.tensor([prompt + completion])
    logits = policy(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def train_step(policy, optimizer, samples) -> float:
    rewards = torch.tensor([reward(c) for _, c, _ in samples])
    adv = advantages(rewards)
    optimizer.zero_grad()
    loss = sum(
        -a * policy_logprobs(policy, p, c).sum() for a, (p, c, _) in zip(adv, samples, strict=True)
    )
    (loss / len(samples)).backward()
    optimizer.step()
    return float(rewards.mean())


def save_weights(policy, checkpoint: Path, out: Path) -> None:
    """A checkpoint folder of the policy's weights (config and tokenizer copied)."""
    shutil.copytree(checkpoint, out, dirs_exist_ok=True)
    state = {k: v.detach().clone().contiguous() for k, v in policy.state_dict().items()}
    if policy.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, out / "model.safetensors", {"format": "pt"})


def main(checkpoint: str, steps: int = 3, lr: float = 3e-2) -> dict[str, object]:
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    engine_args = {"dtype": "float32", "max_model_len": 64, "block_size": 8}
    llm = LLM(checkpoint, **engine_args)
    mean_rewards, max_gap = [], 0.0
    for step in range(steps):
        samples = rollouts(llm, step)
        with torch.no_grad():  # the engine's rollout logprobs are the policy's own
            for prompt, completion, logprobs in samples:
                ours = policy_logprobs(policy, prompt, completion)
                max_gap = max(max_gap, float((ours - torch.tensor(logprobs)).abs().max()))
        mean_rewards.append(train_step(policy, optimizer, samples))
        llm.update_weights(policy.state_dict().items())
        print(f"step {step}: mean reward {mean_rewards[-1]:.3f}, logprob gap {max_gap:.2e}")
    updated = rollouts(llm, steps)
    with tempfile.TemporaryDirectory() as tmp:
        save_weights(policy, Path(checkpoint), Path(tmp))
        fresh = rollouts(LLM(tmp, **engine_args), steps)
    same = updated == fresh
    print(f"rollouts of the updated engine == a fresh engine on the new weights: {same}")
    return {"mean_rewards": mean_rewards, "max_logprob_gap": max_gap, "fresh_equal": same,
            "updated": updated}  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    main(args.checkpoint, args.steps)
