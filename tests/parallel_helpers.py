"""Shared pieces of the multi-process tests: a tiny config whose head counts split over 2 and 4 ranks,
a rollout batch with images, a video and text-only prompts, process-group setup for spawned ranks.
Imports neither transformers nor the engine, so a spawned rank starts in about torch's import time."""

from __future__ import annotations

import faulthandler
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import IMG, VE, VID, VS, make_prompt, random_text_ids

from rollplex.models import ModelConfig, Qwen25VL, TextConfig, VisionConfig, init_weights
from rollplex.rl.algos import grpo_advantages
from rollplex.rl.batch import RolloutBatch


def tiny_cfg(tie: bool = False) -> ModelConfig:
    """4 query / 2 KV heads, intermediate 112, vocab 320: tensor parallel over 2 and 4 ranks (4 ranks
    replicate each KV head twice)."""
    text = TextConfig(vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, mrope_section=(2, 3, 3), rope_theta=10000.0,
                      tie_word_embeddings=tie)
    vision = VisionConfig(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, window_size=56,
                          out_hidden_size=64, fullatt_block_indexes=(1,))
    return ModelConfig(text=text, vision=vision, image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS,
                       vision_end_token_id=VE, eos_token_id=2)


def tiny_model(cfg: ModelConfig, seed: int = 0) -> Qwen25VL:
    return init_weights(Qwen25VL(cfg), seed=seed, std=0.1).eval()


def rollout_batch(seed: int = 0, prompts: int = 5, n: int = 2,
                  R: int = 6) -> tuple[RolloutBatch, torch.Tensor, torch.Tensor]:
    """(batch, advantages [N], reference logprobs [N, R]): prompts 0 and 3 carry an image, prompt 2 a
    video, the rest are text; responses of varied lengths."""
    g = torch.Generator().manual_seed(seed)
    vision = {0: dict(images=[(1, 4, 4)]), 2: dict(videos=[(2, 4, 4)]), 3: dict(images=[(1, 4, 8)])}
    ps = [make_prompt(g, text_len=(3 + i, 2 + i % 3), **vision.get(i, {})) for i in range(prompts)]
    group = [i for i in range(prompts) for _ in range(n)]
    responses = [random_text_ids(int(torch.randint(2, R + 1, (1,), generator=g)), g, vocab=290).tolist()
                 for _ in group]
    rewards = torch.rand(len(group), generator=g)
    batch = RolloutBatch.from_samples(ps, group, responses, pad_id=0, rewards=rewards.tolist())
    ref = -torch.rand(batch.responses.shape, generator=g) * batch.mask
    return batch, grpo_advantages(batch.rewards, batch.group), ref


def init_group(rank: int, world: int, init: str) -> None:
    # a rank stuck in a collective prints its stack and exits, failing the test instead of hanging it
    faulthandler.dump_traceback_later(240, exit=True)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)  # the ranks share two cores


def spawn(worker, args: tuple, nprocs: int) -> None:
    """Run `worker(rank, *args)` in `nprocs` spawned processes and wait for them. A rank whose worker
    returned ends with os._exit(0) after flushing its output, as `parallel.launch.end_rank` ends a
    torchrun rank: the interpreter's teardown can abort in gloo's threads ("terminate called without an
    active exception"), which mp.spawn reports as a failed rank although every check passed. A worker
    that raised is reported by mp.spawn as before (its traceback is written before teardown)."""
    mp.spawn(_rank_main, args=(worker, *args), nprocs=nprocs, join=True)


def _rank_main(rank: int, worker, *args) -> None:
    worker(rank, *args)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
