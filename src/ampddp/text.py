"""The bundled text data set's old path, kept for recipes that say ``data.name: ampddp.text:python_docs``
and code that imports from here; it lives in ``ampddp.zoo.text``."""

from ampddp.zoo.text import VOCAB_SIZE, ByteWindows, corpus_bytes, python_docs

__all__ = ["VOCAB_SIZE", "ByteWindows", "corpus_bytes", "python_docs"]
