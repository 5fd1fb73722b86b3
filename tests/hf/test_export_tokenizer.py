"""An export of a training run is usable by `tensorpar generate` and transformers, whichever tokenizer the run
trained with (issue 27 item 14): ``AutoTokenizer.from_pretrained(export)`` turns text into the ids the training
used and back, and `tensorpar generate --model export` continues prompts as transformers' greedy ``generate`` does.

Before, a byte-level run's export had no tokenizer files, and `tensorpar generate` failed with transformers'
"You need to have sentencepiece or tiktoken installed". Everything runs in this process at tp = 1: the tiny preset
trains 2 steps in a few seconds.
"""
import pytest
import torch

from tensorpar.cli import main
from tensorpar.data import load_tokenizer

# Every kind of text a byte-level tokenizer must keep byte for byte: multi-byte characters (2, 3 and 4 bytes),
# the characters that are GPT-2 byte symbols themselves (U+00FF is byte 0xFF's, U+0100 byte 0x00's: they must
# still encode as their own UTF-8 bytes), control bytes, runs of spaces, a leading space, CRLF, and the spacing
# that transformers' clean-up would change (" ." and " 's").
TEXTS = ["The quick brown fox.", " leading space", "two  spaces\tand a tab\r\nCRLF\n\n", "caf\u00e9 \u00fcber",
         "\u00ff \u0100 \u0101 \u0120", "\x00\x01\x7f", "\u65e5\u672c\u8a9e \U0001F600 \u0915\u094d\u0937",
         "a . b , c 's", ""]
PROMPTS = ["Alas the", "Hark 3"]     # two lengths: the batched generate pads one of them
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    lines = [f"{w} {i % 7} the quick brown fox jumps over the lazy dog {i % 3}." for i, w in
             enumerate(["Alas", "Hark", "Prithee", "Forsooth"] * 60)]
    p = tmp_path_factory.mktemp("text") / "corpus.txt"
    p.write_text("\n".join(lines))
    return str(p)


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory):
    """A Hugging Face model folder (a random 2-layer llama) with the byte-level BPE tokenizer scheme of GPT-2 /
    SmolLM2: a few merges and an end-of-text token (what `--model smollm2` gives, small enough to make here)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from tensorpar.data.tokenizers import bytes_to_unicode

    bu = bytes_to_unicode()
    vocab = {bu[b]: b for b in range(256)}
    merges = [("t", "h"), ("th", "e"), (bu[ord(" ")], "the"), ("o", "x")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    folder = tmp_path_factory.mktemp("bpe")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>")
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 eos_token_id=tok.eos_token_id, bos_token_id=None)).save_pretrained(folder)
    return str(folder)


def _export(model: str, text_file: str, folder) -> str:
    """Train ``model`` 2 steps with its own tokenizer (a preset: bytes) and export it."""
    export = folder / "hf"
    rc = main(["train", "--tp", "1", "--model", model, "--data", text_file, "--seq-len", "16",
               "--batch-size", "2", "--steps", "2", "--eval-batches", "1", "--warmup-steps", "1", "--save-every", "0",
               "--no-progress", "--out", str(folder / "run"), "--export", str(export)])
    assert rc == 0
    return str(export)


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_generate_from_an_export_of_each_tokenizer_kind(kind, text_file, bpe_folder, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = "bytes" if kind == "bytes" else bpe_folder
    export = _export("tiny" if kind == "bytes" else bpe_folder, text_file, tmp_path)
    capsys.readouterr()

    # the exported tokenizer gives the training's ids (the run's own tokenizer, tensorpar.data) and back the text
    trained = load_tokenizer(spec)
    tok = AutoTokenizer.from_pretrained(export)
    assert len(tok) == trained.vocab_size
    for text in TEXTS:
        ids = trained.encode(text)
        assert tok.encode(text) == ids and tok(text)["input_ids"] == ids, repr(text)
        assert tok.decode(ids) == text, repr(text)
    if kind == "bytes":
        assert tok.encode("\u00ff") == [0xC3, 0xBF]  # U+00FF is two bytes, not byte 0xFF's symbol as one id

    # tensorpar generate, two prompts of different lengths (left-padded in one batch), greedy
    rc = main(["generate", "--model", export, "--tp", "1", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
               "--max-new-tokens", str(NEW_TOKENS)])
    out = capsys.readouterr()
    assert rc == 0, out.err

    # transformers, each prompt alone (no padding), greedy: the same continuation. The tiny model's argmax margins
    # are far above the float32 difference between the two forwards (~1e-6), so the tokens are equal.
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    lines = out.out.splitlines()
    for p in PROMPTS:
        ids = torch.tensor([tok.encode(p)])
        with torch.no_grad():
            new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0)[0, ids.shape[1]:]
        assert p + tok.decode(new, skip_special_tokens=True) in lines, (p, lines)
