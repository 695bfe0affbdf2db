"""`--task gpt`: a small causal transformer language model, the shape of a real LLM training script.

Copy this file to start your own. What it shows: a model whose blocks sit in an `nn.ModuleList` (what
`--strategy fsdp` shards one by one), dict batches made by a `collate_fn`, your own `step` returning the loss
and an extra metric, AdamW with weight-decay groups built by parameter name (`optimizer`, `params.named()`) and
warm-up + cosine (`scheduler`), and an evaluation set with its own `eval_step`.
Run it:

    python -m hpc_ddp.submit --local --task gpt --epochs 2 --clip-grad 1.0            # add --amp bf16 on GPUs

The text is generated here, deterministically from --seed (no download): sentences of a small made-up language
("the quick fox sees a red ball .") whose grammar a model can learn, so next-token accuracy climbs well above
chance within a few hundred steps.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from hpc_ddp.run.loop.params import Parameters
from hpc_ddp.run.tasks import Task

WORDS = {
    "det": ["the", "a", "every", "one"],
    "adj": ["quick", "red", "small", "old", "bright", "quiet"],
    "noun": ["fox", "ball", "cat", "tree", "ship", "bird", "stone"],
    "verb": ["sees", "finds", "likes", "follows", "moves"],
}
VOCAB = ["<pad>", "."] + [w for group in WORDS.values() for w in group]
CONTEXT = 32  # tokens a sample is trained on


def sentence(rng: random.Random) -> list[str]:
    """det [adj] noun verb det [adj] noun ."""
    words: list[str] = []
    for part in ("det", "adj?", "noun", "verb", "det", "adj?", "noun"):
        if part.endswith("?"):
            if rng.random() < 0.5:
                words.append(rng.choice(WORDS[part[:-1]]))
            continue
        words.append(rng.choice(WORDS[part]))
    return [*words, "."]


def corpus(tokens: int, seed: int) -> torch.Tensor:
    """`tokens` token ids of generated text, the same for every rank with the same seed."""
    rng, ids = random.Random(seed), []
    while len(ids) < tokens:
        ids += [VOCAB.index(w) for w in sentence(rng)]
    return torch.tensor(ids[:tokens], dtype=torch.long)


class Windows(torch.utils.data.Dataset):
    """Overlapping windows of CONTEXT + 1 tokens (inputs and their next tokens)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return (len(self.ids) - 1) // CONTEXT

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i * CONTEXT : (i + 1) * CONTEXT + 1]


def collate(windows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A dict batch, as Hugging Face models take it."""
    block = torch.stack(windows)
    return {"input_ids": block[:, :-1], "labels": block[:, 1:]}


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, width: int = 64, depth: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(CONTEXT, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))  # what fsdp shards
        self.norm = nn.LayerNorm(width)
        # No bias, as GPT-2's: a biased Linear on (batch, tokens, width) returns a view, on which FSDP2 warns
        # (an in-place op on it would skip its backward hook).
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool, device=input_ids.device), diagonal=1)
        x = self.embed(input_ids) + self.position[:length]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def _loss_and_accuracy(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(batch["input_ids"])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
    accuracy = (logits.argmax(-1) == batch["labels"]).float().mean()
    return loss, accuracy


def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch: the loss to minimise, and next-token accuracy as an extra metric."""
    loss, accuracy = _loss_and_accuracy(model, batch)
    return loss, {"accuracy": accuracy.detach()}


def eval_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Means over the batch; the kit weights them by samples across ranks (perplexity = exp(loss))."""
    loss, accuracy = _loss_and_accuracy(model, batch)
    return {"loss": loss, "accuracy": accuracy}


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    from hpc_ddp.run.loop import schedules

    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, schedules.Factor("cosine", total_steps // 10, total_steps)
    )


def no_decay(name: str) -> bool:
    """Biases, norms' weights and embeddings are not decayed (as in GPT-2's and nanoGPT's training)."""
    return name.endswith("bias") or ".norm" in name or name.startswith(("norm.", "embed.", "position"))


def adamw(lr: float) -> Callable[[Parameters], torch.optim.Optimizer]:
    """AdamW with two groups, built by parameter name. `params.named()` gives the names of the model as the kit
    trains it (after DDP or FSDP wraps it: the same names, no `module.` prefix), so this works under both."""

    def build(params: Parameters) -> torch.optim.Optimizer:
        named = params.named()
        groups = [
            {"params": [p for n, p in named if not no_decay(n)], "weight_decay": 0.01},
            {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr)

    return build


def build(config: object) -> Task:
    seed = int(getattr(config, "seed", 0))
    lr = float(getattr(config, "lr", 0.01))
    return Task(
        model=TinyGPT(len(VOCAB)),
        dataset=Windows(corpus(CONTEXT * 2048 + 1, seed)),
        step=step,
        optimizer=adamw(lr),
        scheduler=warmup_cosine,
        collate_fn=collate,
        eval_dataset=Windows(corpus(CONTEXT * 256 + 1, seed + 1)),  # other sentences, same language
        eval_step=eval_step,
    )
