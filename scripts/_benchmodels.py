"""The realistic models of the GPU benchmarks: a ~110M-parameter transformer LM and a ResNet-50.

`scripts/_benchjob.py` builds them when ELASTICD_BENCH_MODEL is `lm` or `cnn`, so bench_multiplex.py times
them as it times its MLP: N logical workers on one GPU against the plain gradient-accumulation loop.
Both are written from torch's own modules (the LM from `nn.TransformerEncoderLayer`, the CNN as
torchvision's ResNet-50 lays it out: bottleneck blocks [3, 4, 6, 3], 25.6M parameters), so the benchmark
needs nothing beyond torch. Each returns logits the job's `F.cross_entropy(model(x), y)` takes as they
come: the LM flattens its (batch, tokens, vocab) logits to (batch * tokens, vocab).

The data is a small pool of seeded batches built once per process and handed out in turn: generating a
224x224 image batch per micro-batch on the host would time the generator, not the runtime.
"""

from __future__ import annotations

import torch
import torch.nn as nn

VOCAB, D_MODEL, LAYERS, HEADS, SEQ = 16384, 768, 12, 12, 512
IMAGE, CLASSES = 224, 1000
POOL = 4


class LM(nn.Module):
    """A GPT-2-small-sized causal LM: 12 pre-norm layers of width 768 (110M parameters with the head)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(SEQ, D_MODEL)
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, 4 * D_MODEL, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h)).flatten(0, 1)


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Identity() if stride == 1 and cin == cout else
                     nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def resnet50() -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = 4 * width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, CLASSES))


def build(kind: str) -> nn.Module:
    # TF32 matrix products, as GPU training scripts set them (nanoGPT, torchvision's reference recipes):
    # fp32 products would make each micro-batch several times longer and the runtime's share look smaller.
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return LM() if kind == "lm" else resnet50()


_POOLS: dict[tuple[str, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}


def batch(kind: str, rank: int, step: int, workers: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s micro-batch at `step`, the same in every variant: one of POOL seeded batches."""
    pool = _POOLS.get((kind, size))
    if pool is None:
        g = torch.Generator().manual_seed(1234)
        if kind == "lm":
            pool = [(torch.randint(VOCAB, (size, SEQ), generator=g), torch.randint(VOCAB, (size * SEQ,), generator=g))
                    for _ in range(POOL)]
        else:
            pool = [(torch.randn(size, 3, IMAGE, IMAGE, generator=g), torch.randint(CLASSES, (size,), generator=g))
                    for _ in range(POOL)]
        _POOLS[(kind, size)] = pool
    return pool[(step * workers + rank) % POOL]
