"""Training data: the Shakespeare corpus, its tokenizers, and resumable language-model batches."""
from tensorpar.data.batches import LMBatches
from tensorpar.data.shakespeare import TokenizedCorpus, Work, load_corpus, load_works
from tensorpar.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["LMBatches", "TokenizedCorpus", "Work", "load_corpus", "load_works", "ByteTokenizer", "HFTokenizer",
           "load_tokenizer"]
