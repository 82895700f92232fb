"""The conformance matrix's cases: the module families people train, each with an optimizer and a scheduler.

A case builds a small model, draws one rank's batch for a step from a generator, and computes that batch's
loss. Cases are grouped into families (one job run trains a whole family, each model under its own
`ctx.replicate`), and the families together cover torch.nn's families, Hugging Face models built from
configs, the common optimizers and the common schedulers (tests/system/test_conformance.py, docs/conformance.md).

Attention key biases get a gradient that is zero but for round-off; any optimizer that divides by a running
gradient size (Adam, Adagrad, RMSprop) turns that round-off into O(lr) steps under any change of summation
order, DDP's own included. Models with such biases are trained with SGD here; Adam-family optimizers train
the bias-free attention cases. The same holds for a bias right before a normalization that removes the mean
(BatchNorm, InstanceNorm): such layers are built without one, as ResNets build them.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrizations
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.optim import lr_scheduler as lr

STEPS = int(os.environ.get("ELASTICD_MATRIX_STEPS", "8"))
D, HEADS, SEQ, BATCH, VOCAB = 16, 2, 8, 4, 32

Batch = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Case:
    """One model of the matrix: how to build it, feed it and train it."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    register_scheduler: bool = True   # passed to ctx.replicate, else left for elasticd to find
    plateau: bool = False             # scheduler.step(metric): the loss averaged over every rank
    ema_teacher: bool = False         # a second instance, moved towards the model after every step (DINO)
    evaluate: Callable[[nn.Module, Batch], torch.Tensor] | None = None   # in eval mode, no grad; default: loss


# --- batches -------------------------------------------------------------------------------------------

def tokens(g: torch.Generator) -> Batch:
    seq = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def padded_tokens(g: torch.Generator) -> Batch:
    x, y = tokens(g)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH,), generator=g)
    pad = torch.arange(SEQ)[None, :] >= lengths[:, None]
    return x, y, pad


def features(*shape: int) -> Callable[[torch.Generator], Batch]:
    def draw(g: torch.Generator) -> Batch:
        x = torch.randn(BATCH, *shape, generator=g)
        return x, torch.randint(0, 4, (BATCH,), generator=g)
    return draw


def seqs(g: torch.Generator) -> Batch:
    x = torch.randn(BATCH, SEQ, 8, generator=g)
    lengths = torch.randint(2, SEQ + 1, (BATCH,), generator=g)
    return x, lengths, torch.randint(0, 4, (BATCH,), generator=g)


def causal(n: int) -> torch.Tensor:
    return nn.Transformer.generate_square_subsequent_mask(n)


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# --- torch.nn attention --------------------------------------------------------------------------------

class EncoderLM(nn.Module):
    """`nn.TransformerEncoder` LM: its constructor deep-copies the layer (`_get_clones`)."""

    def __init__(self, norm_first: bool = False, bias: bool = True, nested: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, 2 * D, dropout=0.1, batch_first=True, norm_first=norm_first,
                                           bias=bias)
        self.enc = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(D) if norm_first else None,
                                         enable_nested_tensor=nested and not norm_first)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None, is_causal: bool = True) -> torch.Tensor:
        mask = causal(x.shape[1]) if is_causal else None
        return self.head(self.enc(self.emb(x), mask=mask, is_causal=is_causal, src_key_padding_mask=pad))


class DecoderLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        layer = nn.TransformerDecoderLayer(D, HEADS, 2 * D, dropout=0.1, batch_first=True, bias=False)
        self.dec = nn.TransformerDecoder(layer, 2)
        self.memory = nn.Linear(4, D, bias=False)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        memory = self.memory(F.one_hot(y[:, :3] % 4, 4).float())
        return self.head(self.dec(self.emb(x), memory, tgt_mask=causal(x.shape[1]), tgt_is_causal=True))


class Seq2Seq(nn.Module):
    """The whole `nn.Transformer`: encoder and decoder stacks, both built by `_get_clones`."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.t = nn.Transformer(D, HEADS, num_encoder_layers=1, num_decoder_layers=2, dim_feedforward=2 * D,
                                dropout=0.1, batch_first=True, bias=False)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        return self.head(self.t(self.emb(x.flip(1)), self.emb(x), tgt_mask=causal(n), tgt_is_causal=True))


class Attention(nn.Module):
    """`nn.MultiheadAttention` used directly: cross-attention with its own key and value sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.ctx = nn.Linear(4, 12, bias=False)
        self.att = nn.MultiheadAttention(D, HEADS, dropout=0.1, bias=False, kdim=12, vdim=12, batch_first=True)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        c = self.ctx(F.one_hot(y % 4, 4).float())
        h, _ = self.att(self.emb(x), c, c, need_weights=False)
        return self.head(h)


class _Layer(nn.Module):
    def __init__(self, attn: nn.MultiheadAttention, ff: nn.Module) -> None:
        super().__init__()
        self.attn, self.ff = attn, ff
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal(x.shape[1]), need_weights=False)[0]
        return x + self.ff(self.norm2(x))


class _Stack(nn.Module):
    def __init__(self, layers: nn.ModuleList) -> None:
        super().__init__()
        self.emb, self.layers, self.head = nn.Embedding(VOCAB, D), layers, nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def built_from_copies() -> nn.Module:
    """Assembled as The Annotated Transformer's `make_model` does: `copy.deepcopy` of one attention and one
    feed-forward block, outside any constructor."""
    c = copy.deepcopy
    attn = nn.MultiheadAttention(D, HEADS, bias=False, batch_first=True)
    ff = nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(), nn.Dropout(0.1), nn.Linear(2 * D, D))
    return _Stack(nn.ModuleList([_Layer(c(attn), c(ff)) for _ in range(2)]))


def _sgd_momentum(p: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-4)


ATTENTION = [
    Case("encoder_post_norm", lambda: EncoderLM(), padded_tokens,
         lambda m, b: lm_loss(m(b[0], b[2]), b[1]), _sgd_momentum,
         lambda o: lr.OneCycleLR(o, max_lr=0.1, total_steps=STEPS + 4),
         # without a causal mask, an evaluation with a padding mask takes torch's nested-tensor fast path
         evaluate=lambda m, b: lm_loss(m(b[0], b[2], is_causal=False).masked_fill(b[2][..., None], 0), b[1])),
    Case("encoder_pre_norm_causal", lambda: EncoderLM(norm_first=True, bias=False), tokens,
         lambda m, b: lm_loss(m(b[0]), b[1]),
         lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1, foreach=True),
         lambda o: lr.CosineAnnealingWarmRestarts(o, T_0=3), register_scheduler=False),
    Case("decoder", DecoderLM, tokens, lambda m, b: lm_loss(m(*b), b[1]),
         lambda p: torch.optim.Adam(p, lr=3e-3, foreach=False),
         lambda o: lr.SequentialLR(o, [lr.LinearLR(o, 0.2, total_iters=3), lr.ExponentialLR(o, 0.9)],
                                   milestones=[3])),
    Case("transformer", Seq2Seq, tokens, lambda m, b: lm_loss(m(b[0]), b[1]),
         lambda p: torch.optim.NAdam(p, lr=3e-3)),
    Case("multihead_attention", Attention, tokens, lambda m, b: lm_loss(m(*b), b[1]),
         lambda p: torch.optim.RAdam(p, lr=0.05),
         lambda o: lr.ReduceLROnPlateau(o, factor=0.5, patience=0, threshold=0.5), plateau=True),
    Case("built_from_copies_with_ema_teacher", built_from_copies, tokens, lambda m, b: lm_loss(m(b[0]), b[1]),
         lambda p: torch.optim.Adam(p, lr=3e-3, fused=True), ema_teacher=True),
]


# --- recurrent -----------------------------------------------------------------------------------------

class Recurrent(nn.Module):
    def __init__(self, rnn: nn.Module, out: int, packed: bool = False) -> None:
        super().__init__()
        self.rnn, self.packed = rnn, packed
        self.head = nn.Linear(out, 4)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if self.packed:
            out, _ = self.rnn(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
            h, _ = pad_packed_sequence(out, batch_first=True, total_length=SEQ)
            h = h.sum(1) / lengths[:, None]
        else:
            h = self.rnn(x)[0].mean(1)
        return self.head(h)


def _classify(m: nn.Module, b: Batch) -> torch.Tensor:
    return F.cross_entropy(m(*b[:-1]), b[-1])


RECURRENT = [
    Case("lstm_stacked_bidirectional",
         lambda: Recurrent(nn.LSTM(8, D, num_layers=2, bidirectional=True, dropout=0.1, batch_first=True), 2 * D),
         seqs, _classify, lambda p: torch.optim.Adagrad(p, lr=0.05),
         lambda o: lr.StepLR(o, 3, 0.5), register_scheduler=False),
    Case("lstm_projected_packed",
         lambda: Recurrent(nn.LSTM(8, D, proj_size=6, batch_first=True), 6, packed=True),
         seqs, _classify, lambda p: torch.optim.AdamW(p, lr=3e-3, foreach=False)),
    Case("gru_bidirectional_packed",
         lambda: Recurrent(nn.GRU(8, D, bidirectional=True, batch_first=True), 2 * D, packed=True),
         seqs, _classify, lambda p: torch.optim.RMSprop(p, lr=3e-3, momentum=0.9, centered=True),
         lambda o: lr.CosineAnnealingLR(o, T_max=STEPS)),
    Case("rnn_relu_stacked",
         lambda: Recurrent(nn.RNN(8, D, num_layers=2, nonlinearity="relu", batch_first=True), D),
         seqs, _classify, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
         lambda o: lr.ExponentialLR(o, 0.9)),
]


# --- convolutions and their norms --------------------------------------------------------------------

class BasicBlock(nn.Module):
    """A ResNet basic block with a strided 1x1 shortcut, as torchvision's."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.down(x))


class InvertedResidual(nn.Module):
    """A MobileNetV3 block: 1x1 expansion, depthwise 3x3, squeeze-and-excitation, 1x1 projection."""

    def __init__(self, c: int, expand: int = 4) -> None:
        super().__init__()
        h = c * expand
        self.expand = nn.Sequential(nn.Conv2d(c, h, 1, bias=False), nn.BatchNorm2d(h), nn.Hardswish())
        self.depthwise = nn.Sequential(nn.Conv2d(h, h, 3, 1, 1, groups=h, bias=False), nn.BatchNorm2d(h), nn.ReLU6())
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(h, 4, 1), nn.ReLU(), nn.Conv2d(4, h, 1),
                                nn.Hardsigmoid())
        self.project = nn.Sequential(nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.depthwise(self.expand(x))
        return x + self.project(h * self.se(h))


def _head(*body: nn.Module, channels: int) -> nn.Module:
    return nn.Sequential(*body, _Pool(), nn.Linear(channels, 4))


class _Pool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(2).mean(2)


class AutoEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.GroupNorm(2, 8), nn.SiLU())
        self.dec = nn.ConvTranspose2d(8, 3, 4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.enc(x))


CONV = [
    Case("conv1d_batchnorm1d",
         lambda: _head(nn.Conv1d(3, 8, 3, padding=1), nn.BatchNorm1d(8), nn.ReLU(), channels=8),
         features(3, 16), _classify, _sgd_momentum),
    Case("resnet_basic_block", lambda: _head(nn.Conv2d(3, 8, 3, 1, 1), BasicBlock(8, 16, 2), channels=16),
         features(3, 8, 8), _classify,
         lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
         lambda o: lr.OneCycleLR(o, max_lr=0.1, total_steps=STEPS + 4), register_scheduler=False),
    Case("mobilenet_inverted_residual",
         lambda: _head(nn.Conv2d(3, 8, 3, 1, 1), InvertedResidual(8), channels=8),
         features(3, 8, 8), _classify, lambda p: torch.optim.RMSprop(p, lr=1e-3)),
    Case("conv3d_instancenorm3d",
         lambda: _head(nn.Conv3d(2, 4, 3, padding=1, bias=False), nn.InstanceNorm3d(4, affine=True, track_running_stats=True),
                       nn.GELU(), channels=4),
         features(2, 4, 4, 4), _classify, lambda p: torch.optim.Adam(p, lr=3e-3, foreach=True)),
    Case("conv_transpose2d_groupnorm", AutoEncoder, features(3, 8, 8),
         lambda m, b: F.mse_loss(m(b[0]), b[0]), lambda p: torch.optim.Adam(p, lr=3e-3, amsgrad=True),
         lambda o: lr.MultiStepLR(o, [2, 5], 0.5)),
]


# --- normalization and embeddings ----------------------------------------------------------------------

class Norms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, D), nn.LayerNorm(D), nn.GELU(), nn.Linear(D, D), nn.RMSNorm(D),
                                 nn.Dropout(0.1), nn.Linear(D, D, bias=False),
                                 nn.BatchNorm1d(D, momentum=None), nn.ReLU(),
                                 nn.Linear(D, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Bags(nn.Module):
    """Dense `nn.Embedding` (with a padding row) beside `nn.EmbeddingBag` in mean and max mode, with offsets."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D, padding_idx=0)
        self.mean = nn.EmbeddingBag(VOCAB, D, mode="mean")
        self.max = nn.EmbeddingBag(VOCAB, D, mode="max")
        self.head = nn.Linear(3 * D, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(0, x.numel(), SEQ, device=x.device)
        flat = x.reshape(-1)
        return self.head(torch.cat([self.emb(x).mean(1), self.mean(flat, offsets), self.max(flat, offsets)], 1))


NORMS = [
    Case("layernorm_rmsnorm_cumulative_batchnorm", Norms, features(12), _classify,
         lambda p: torch.optim.AdamW(p, lr=3e-3)),
    Case("instancenorm2d_affine", lambda: _head(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.InstanceNorm2d(8, affine=True),
                                                nn.ReLU(), channels=8),
         features(3, 8, 8), _classify, lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=0.01)),
    Case("embedding_and_embedding_bags", Bags, tokens, lambda m, b: F.cross_entropy(m(*b), b[1][:, 0] % 4),
         lambda p: torch.optim.SGD(p, lr=0.1), lambda o: lr.LambdaLR(o, lambda s: 1 / (1 + s))),
]


# --- structure: parametrizations, tied and frozen weights, non-persistent buffers ---------------------

class Parametrized(nn.Module):
    """weight_norm, spectral_norm (its power iteration updates buffers in every training forward) and
    orthogonal, from torch.nn.utils.parametrizations."""

    def __init__(self) -> None:
        super().__init__()
        self.a = parametrizations.weight_norm(nn.Linear(12, D))
        self.b = parametrizations.spectral_norm(nn.Linear(D, D))
        self.c = parametrizations.orthogonal(nn.Linear(D, D))
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


class TiedFrozen(nn.Module):
    """An output head tied to the embedding, a frozen submodule left out of the optimizer, a constant
    non-persistent buffer (a rotary table, as Llama's) and one the forward updates (a running count)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.frozen = nn.Linear(D, D).requires_grad_(False)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        angles = torch.arange(SEQ)[:, None] / 10_000 ** (torch.arange(D // 2) / (D // 2))
        self.register_buffer("rotary", torch.cat([angles.sin(), angles.cos()], 1), persistent=False)
        self.register_buffer("seen", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += 1
        h = self.emb(x) + self.rotary[: x.shape[1]]
        h = h + torch.tanh(self.mix(self.frozen(h))) * (1 + 1 / self.seen.clamp(min=1))
        return self.head(h)


STRUCTURE = [
    Case("parametrizations", Parametrized, features(12), _classify,
         lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5, dampening=0.1)),
    Case("tied_frozen_nonpersistent", TiedFrozen, tokens, lambda m, b: lm_loss(m(b[0]), b[1]),
         lambda p: torch.optim.Adamax(p, lr=3e-3),
         lambda o: lr.PolynomialLR(o, total_iters=STEPS, power=2.0), register_scheduler=False),
]


# --- Hugging Face transformers, built from configs (nothing downloaded) ---------------------------------

def _hf(kind: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers as t
        if kind == "gpt2":
            return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=D, n_layer=2, n_head=HEADS,
                                                  bos_token_id=0, eos_token_id=0))
        if kind == "bert":
            return t.BertForMaskedLM(t.BertConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2,
                                                  num_attention_heads=HEADS, intermediate_size=2 * D,
                                                  max_position_embeddings=SEQ))
        if kind == "t5":
            return t.T5ForConditionalGeneration(t.T5Config(vocab_size=VOCAB, d_model=D, d_kv=D // HEADS, d_ff=2 * D,
                                                           num_layers=1, num_decoder_layers=2, num_heads=HEADS,
                                                           decoder_start_token_id=0, pad_token_id=0))
        if kind == "llama":
            return t.LlamaForCausalLM(t.LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=2 * D,
                                                    num_hidden_layers=2, num_attention_heads=HEADS,
                                                    num_key_value_heads=1, max_position_embeddings=2 * SEQ))
        if kind == "vit":
            return t.ViTForImageClassification(t.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=D,
                                                           num_hidden_layers=1, num_attention_heads=HEADS,
                                                           intermediate_size=2 * D, num_labels=4))
        raise ValueError(kind)
    return build


def _warmup(o: torch.optim.Optimizer) -> Any:
    return lr.LambdaLR(o, lambda s: min(1.0, (s + 1) / 4))


HF = [
    Case("hf_gpt2", _hf("gpt2"), tokens, lambda m, b: m(input_ids=b[0], labels=b[0]).loss, _sgd_momentum),
    Case("hf_bert_mlm", _hf("bert"), tokens, lambda m, b: m(input_ids=b[0], labels=b[1]).loss,
         lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True)),
    Case("hf_t5", _hf("t5"), tokens, lambda m, b: m(input_ids=b[0], labels=b[1]).loss,
         lambda p: torch.optim.AdamW(p, lr=3e-3, foreach=False), _warmup),
    Case("hf_llama", _hf("llama"), tokens, lambda m, b: m(input_ids=b[0], labels=b[0]).loss,
         lambda p: torch.optim.AdamW(p, lr=3e-3, foreach=True), _warmup, register_scheduler=False),
    Case("hf_vit", _hf("vit"), features(3, 8, 8), lambda m, b: m(pixel_values=b[0], labels=b[1]).loss,
         lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
]


# --- the issue's own job: a TransformerEncoder LM, AdamW, LambdaLR, ctx.clip_grad_norm_ ------------------

LM = [
    Case("encoder_lm", lambda: EncoderLM(bias=False, nested=False), tokens, lambda m, b: lm_loss(m(b[0]), b[1]),
         lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1), _warmup),
]

FAMILIES: dict[str, list[Case]] = {"attention": ATTENTION, "recurrent": RECURRENT, "conv": CONV, "norms": NORMS,
                                   "structure": STRUCTURE, "hf": HF, "lm": LM}
