"""What each training stack takes from a batch with boundaries (FeederDataset(boundaries=True),
or packing="best_fit"): Hugging Face's packed inputs, Megatron-LM's masks for its three flags,
and a block-diagonal causal mask for SDPA. docs/packing.md shows each in use.

Every helper reads the batch's compact boundaries (`batch.boundaries`: the document starts
inside each sample, and where a bin's padding begins); a batch without them is refused, as
documents cannot be told apart in general from its tokens (a Hugging Face row or an MDS sample
gets its EOS from the feeder, a window may start inside a document)."""
from __future__ import annotations

import numpy as np
import torch

from feeder.core.errors import Code, FeederError
from feeder.core.layout import label_crosses

from .decode import FeederBatch

IGNORE = -100   # what Hugging Face's and torch's cross entropy leave out


def _bounds(batch: FeederBatch):
    if batch.boundaries is None:
        raise FeederError("this batch carries no boundaries: open the stream with boundaries=True (or "
                          'packing="best_fit")', code=Code.FAILED_PRECONDITION)
    return batch.boundaries


def hf_inputs(batch: FeederBatch, *, whole: bool = False) -> dict[str, torch.Tensor]:
    """A Hugging Face causal LM's packed inputs, as DataCollatorWithFlattening makes them:
    input_ids, position_ids restarting at each document (which transformers turns into a
    per-document mask under FlashAttention or SDPA, but only without a KV cache: call the model
    with use_cache=False), and labels aligned with the inputs (the
    model shifts them) with -100 at each segment's first token, so no token is predicted across
    documents (nor any padding).

    Inputs are tokens[:, :-1]; with whole=True all seq_len + 1 tokens, so that the model's own
    shift predicts exactly the sample's seq_len labels (the integrations' default, batch_dict).
    `shift_labels` (not with whole) are the already shifted targets of every input
    (tokens[:, 1:], -100 where a label crosses into another segment or is padding), for models
    that take them (transformers >= 4.50)."""
    b = _bounds(batch)
    sample_len = batch.tokens.shape[1]
    seg_start, mark = b.segments(sample_len)
    pad = np.arange(sample_len) >= b.lengths[:, None]
    first = torch.from_numpy(mark | pad)
    first[:, 0] = True                   # (no label: nothing before it in the sample)
    labels = batch.tokens.masked_fill(first, IGNORE)
    positions = torch.from_numpy(np.arange(sample_len) - seg_start)
    if whole:
        return {"input_ids": batch.tokens, "position_ids": positions, "labels": labels}
    return {"input_ids": batch.tokens[:, :-1], "position_ids": positions[:, :-1], "labels": labels[:, :-1],
            "shift_labels": labels[:, 1:]}


def megatron_inputs(batch: FeederBatch, *, eod_token: int, reset_position_ids: bool = False,
                    reset_attention_mask: bool = False, eod_mask_loss: bool = False) -> dict[str, torch.Tensor]:
    """Megatron-LM's get_batch: tokens, labels, loss_mask, attention_mask, position_ids, as
    megatron.core.datasets.utils get_ltor_masks_and_position_ids makes them under its three
    flags, from the served boundaries instead of a scan for EOD (which a format may not store):

    * reset_position_ids: positions restart at each document (else 0..seq_len-1);
    * reset_attention_mask: a token attends only within its document (else causal);
    * eod_mask_loss: no loss where the input is the EOD token (Megatron's rule).

    attention_mask is Megatron's: bool [n, 1, seq_len, seq_len], True where attention is
    masked OUT. loss_mask is float32 [n, seq_len], 0 on a bin's padding whatever the flags."""
    b = _bounds(batch)
    seq_len = batch.tokens.shape[1] - 1
    tokens, labels = batch.tokens[:, :-1], batch.tokens[:, 1:]
    loss_mask = batch.loss_mask.clone()
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    position_ids = batch.position_ids if reset_position_ids else \
        torch.arange(seq_len, dtype=torch.int64).expand(len(tokens), seq_len).contiguous()
    allowed = block_causal_mask(batch) if reset_attention_mask else \
        torch.ones(seq_len, seq_len, dtype=torch.bool).tril().expand(len(tokens), 1, seq_len, seq_len)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "attention_mask": ~allowed,
            "position_ids": position_ids}


def model_inputs(batch: FeederBatch) -> dict[str, torch.Tensor]:
    """What trainer/model.py's DecoderLM takes besides the tokens, for documents kept apart:
    position_ids restarting at each document, Megatron's attention_mask (True: masked out)
    within documents, and loss_mask 0 where a label lies across documents or is padding."""
    b = _bounds(batch)
    seq_len = batch.tokens.shape[1] - 1
    crosses = torch.from_numpy(label_crosses(b, seq_len))
    return {"position_ids": batch.position_ids, "attention_mask": ~block_causal_mask(batch),
            "loss_mask": (~crosses).to(torch.float32)}


def segment_ids(batch: FeederBatch) -> torch.Tensor:
    """int64 [n, seq_len]: which segment of its sample each input belongs to (0, 1, ...: the
    documents inside it, and a bin's padding), as torchtitan and Grain serve `segment_ids`."""
    seg_start, mark = _bounds(batch).segments(batch.tokens.shape[1])
    return torch.from_numpy(np.cumsum(mark[:, :-1], axis=1))


def block_causal_mask(batch: FeederBatch) -> torch.Tensor:
    """bool [n, 1, seq_len, seq_len], True where query i may attend key j: j <= i inside the
    same document (torch's scaled_dot_product_attention takes it as attn_mask; transformers
    takes it as a 4D attention_mask under attn_implementation="sdpa")."""
    seg = segment_ids(batch)
    seq_len = seg.shape[1]
    same = seg[:, :, None] == seg[:, None, :]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return (same & causal)[:, None]
