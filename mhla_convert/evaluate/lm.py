"""Language-model metrics beside the held-out loss: perplexity and bits per token, a passkey
retrieval probe for long context, and lm-evaluation-harness tasks.

Passkey retrieval (token ids only, so it runs on any model, tokenizer or not): a filler "sentence"
of random tokens repeated to the context length, a needle (a marker of 4 tokens, then a passkey of
5 random tokens) inserted at a seeded depth, and at the end the marker again; the score is the
fraction of prompts whose greedy continuation is exactly the passkey. A context length counts the
answer too: prompt and continuation together fill it. Tokens are drawn from the
middle of the vocabulary (away from both ends, where models keep their special tokens), marker,
filler and passkey from disjoint sets, all from a generator seeded by (seed, context length).
"""

from __future__ import annotations

import math
import sys

import torch
from torch import nn
from tqdm.auto import tqdm

from .errors import EvalError
from .models import config_value

DEFAULT_PASSKEY_LENGTHS = (256, 1024, 4096)
MARKER_TOKENS = 4
PASSKEY_TOKENS = 5
FILLER_TOKENS = 32
MIN_PASSKEY_LENGTH = 2 * MARKER_TOKENS + 2 * PASSKEY_TOKENS + 8


def perplexity(loss: float) -> dict[str, float]:
    """Perplexity (exp of the token-weighted mean loss, in nats) and bits per token."""
    return {"perplexity": math.exp(loss) if loss < 700 else math.inf, "bits_per_token": loss / math.log(2)}


def passkey_lengths(model: nn.Module, lengths) -> list[int]:
    """The requested context lengths the model can take (up to max_position_embeddings)."""
    limit = config_value(model, "max_position_embeddings") or max(lengths, default=0)
    short = [n for n in lengths if n < MIN_PASSKEY_LENGTH]
    if short:
        raise EvalError(f"passkey context lengths must be at least {MIN_PASSKEY_LENGTH} tokens; got {short}")
    return sorted({n for n in lengths if n <= limit})


def _token_pool(model: nn.Module) -> torch.Tensor:
    vocab = config_value(model, "vocab_size")
    margin = vocab // 8
    special = {config_value(model, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    pool = [i for i in range(margin, vocab - margin) if i not in special]
    if len(pool) < MARKER_TOKENS + FILLER_TOKENS + 2 * PASSKEY_TOKENS:
        raise EvalError(f"a vocabulary of {vocab} tokens is too small for the passkey probe; pass passkey_lengths=()")
    return torch.tensor(pool)


def passkey_prompts(model: nn.Module, length: int, trials: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompts (trials, length − PASSKEY_TOKENS), passkeys (trials, PASSKEY_TOKENS)) for one context length."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + length)
    pool = _token_pool(model)
    pool = pool[torch.randperm(len(pool), generator=g)]
    marker, sentence = pool[:MARKER_TOKENS], pool[MARKER_TOKENS : MARKER_TOKENS + FILLER_TOKENS]
    keys_from = pool[MARKER_TOKENS + FILLER_TOKENS :]
    filler = sentence.repeat(length // FILLER_TOKENS + 1)[: length - 2 * MARKER_TOKENS - 2 * PASSKEY_TOKENS]
    prompts, keys = [], []
    for _ in range(trials):
        key = keys_from[torch.randperm(len(keys_from), generator=g)[:PASSKEY_TOKENS]]
        at = int(torch.randint(0, len(filler) + 1, (1,), generator=g))
        prompts.append(torch.cat([filler[:at], marker, key, filler[at:], marker]))
        keys.append(key)
    return torch.stack(prompts), torch.stack(keys)


def passkey_accuracy(model: nn.Module, lengths, *, trials: int, seed: int,
                     progress: str | None = None) -> dict[str, float]:
    """{"passkey_<length>": exact-match accuracy of greedy continuations} per context length (`progress`: a
    tqdm bar with this label, on stderr when it is a terminal)."""
    device = next(model.parameters()).device
    pad = config_value(model, "pad_token_id")
    out = {}
    for length in tqdm(passkey_lengths(model, lengths), desc=progress, disable=True if progress is None else None,
                       file=sys.stderr, leave=False):
        prompts, keys = passkey_prompts(model, length, trials, seed)
        prompts = prompts.to(device)
        # without a cache every step reads the whole sequence: the score is the model's, whatever its cache does
        generated = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=PASSKEY_TOKENS,
                                   do_sample=False, use_cache=False, pad_token_id=pad if pad is not None else 0)
        generated = generated[:, prompts.shape[1] :].cpu()
        if generated.shape[1] < PASSKEY_TOKENS:  # every prompt stopped early (end of sequence): all wrong
            hits = torch.zeros(trials, dtype=torch.bool)
        else:
            hits = (generated == keys).all(dim=1)
        out[f"passkey_{length}"] = hits.double().mean().item()
    return out


def require_lm_eval() -> None:
    """Tasks need lm-evaluation-harness; say so before any model loads."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise EvalError("lm-eval tasks need the lm-evaluation-harness: pip install 'mhla-convert[eval]' "
                        "(or leave out tasks)") from None


def lm_eval_scores(model: nn.Module, tasks: list[str], *, tokenizer, batch_size: int, limit,
                   seed: int) -> dict[str, float]:
    """lm-evaluation-harness tasks through its Python API; {"<task>/<metric>": value} (no stderrs)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    seeds = dict(random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
    results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), limit=limit, **seeds)["results"]
    return {f"{task}/{metric.removesuffix(',none')}": float(value)
            for task, metrics in sorted(results.items()) for metric, value in sorted(metrics.items())
            if isinstance(value, (int, float)) and not isinstance(value, bool) and "stderr" not in metric}
