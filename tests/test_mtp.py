"""The MTP block (deepseek_v4.md §2.9) against a composition of transformers' own parts."""

from __future__ import annotations

import pytest
import torch

from moebox.model.batch import FlatBatch
from moebox.runtime.loader import load_model
from tests.hf_oracle import HFMTPReference, hf_final_residual, hf_model_from_checkpoint

SEQ = 40


@pytest.fixture(scope="module")
def setup(tiny_ckpt):
    model, _ = load_model(tiny_ckpt, kv_cache_dtype="model", progress=False)
    hf_model, weights = hf_model_from_checkpoint(tiny_ckpt)
    ids = torch.randint(2, model.cfg.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(3))
    return model, hf_model, weights, ids


def test_main_model_exposes_the_final_residual_streams(setup):
    model, hf_model, _, ids = setup
    out = model.forward(FlatBatch.build([(0, 0, ids.tolist())]))
    with torch.no_grad():
        ref = hf_final_residual(hf_model, ids)
    assert out.hidden.shape == (SEQ, model.cfg.hc_mult, model.cfg.hidden_size) == ref.shape
    assert (out.hidden - ref).abs().max().item() <= 1e-4


def test_mtp_block_matches_composition_of_reference_parts(setup):
    """Row t reads the main residual at position t and token t+1, runs at RoPE position t, predicts t+2."""
    model, _, weights, ids = setup
    assert model.mtp, "the tiny checkpoint ships an MTP block"
    hidden = model.forward(FlatBatch.build([(0, 0, ids.tolist())])).hidden
    rows = SEQ - 1
    mtp_batch = FlatBatch.build([(0, 0, ids[1:].tolist())])          # token t+1 at position t
    ours = model.mtp_forward(hidden[:rows], mtp_batch, None, logits_rows=torch.arange(rows)).logits
    with torch.no_grad():
        ref = HFMTPReference(model.cfg, weights).eval()(hidden[:rows], ids[1:])
    assert ours.shape == ref.shape == (rows, model.cfg.vocab_size)
    assert ref.std() > 0.1
    assert (ours - ref).abs().max().item() <= 1e-4
    # it is a different predictor from the main head (which predicts t+1 from the same residual)
    main_logits = model.forward(FlatBatch.build([(0, 0, ids.tolist())]), logits_rows=torch.arange(rows)).logits
    assert (ours - main_logits).abs().max().item() > 0.1


def test_mtp_incremental_equals_full(setup):
    """The MTP layer keeps its own sliding-window cache: chunked/step-wise drafting equals the full pass."""
    model, _, _, ids = setup
    hidden = model.forward(FlatBatch.build([(0, 0, ids.tolist())])).hidden
    rows = SEQ - 1
    full = model.mtp_forward(hidden[:rows], FlatBatch.build([(0, 0, ids[1:].tolist())]), None,
                             logits_rows=torch.arange(rows)).logits
    cache = model.new_cache(2, 128, "cpu")
    outs, pos = [], 0
    for n in [7, 1, 1, 12, 1] + [1] * 17:
        batch = FlatBatch.build([(1, pos, ids[1 + pos:1 + pos + n].tolist())])
        outs.append(model.mtp_forward(hidden[pos:pos + n], batch, cache, logits_rows=torch.arange(n)).logits)
        pos += n
    assert pos == rows
    assert (torch.cat(outs) - full).abs().max().item() <= 1e-5
