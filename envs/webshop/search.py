"""WebShop's search engine: BM25 over each product's indexed text, top 50.

Upstream searches a Pyserini/Lucene index (BM25 with k1 = 0.9, b = 0.4, Porter stemming,
Lucene's 33 English stop words) and returns the top 50 hits
(``web_agent_site/engine/engine.py``: ``SEARCH_RETURN_N = 50``). serl uses ``bm25s``
with the same parameters, its ``lucene`` scoring variant, PyStemmer's ``porter``
stemmer and the same stop words. Rankings are close to Lucene's but not bit-identical
(Lucene's StandardTokenizer and its float encoding of document lengths differ); serl's
own rankings are pinned by tests. Only documents sharing at least one term with the
query are hits, as in Lucene; ties are broken by catalog order so results are stable.
"""

from __future__ import annotations

import re

import bm25s
import numpy as np
import Stemmer
from bm25s.stopwords import STOPWORDS_EN  # Lucene's 33 English stop words

K1, B = 0.9, 0.4
TOP_N = 50
TOKEN_RE = re.compile(r"(?u)\b\w+\b")  # Lucene keeps one-letter tokens; bm25s's default pattern drops them
STOPWORDS = frozenset(STOPWORDS_EN)


class SearchEngine:
    def __init__(self, texts: list[str]):
        self.stemmer = Stemmer.Stemmer("porter")
        corpus = [self.terms(t) for t in texts]
        self.retriever = bm25s.BM25(k1=K1, b=B, method="lucene")
        self.retriever.index(corpus, show_progress=False)
        self.vocab = {term for doc in corpus for term in doc}

    def terms(self, text: str) -> list[str]:
        """Lower-case word tokens, stop words removed, Porter-stemmed; empty stems dropped."""
        words = [w for w in TOKEN_RE.findall(text.lower()) if w not in STOPWORDS]
        return [t for t in self.stemmer.stemWords(words) if t]

    def query_terms(self, query: str) -> list[str]:
        """The query's terms that occur in the index (unknown terms score nothing)."""
        return [t for t in self.terms(query) if t in self.vocab]

    def search(self, query: str, k: int = TOP_N) -> list[int]:
        """Indices of the top-k matching documents, best first."""
        terms = self.query_terms(query)
        if not terms:
            return []
        scores = self.retriever.get_scores(terms)
        hits = np.flatnonzero(scores > 0)
        # best score first; equal scores in catalog order
        ranked = hits[np.lexsort((hits, -scores[hits]))]
        return ranked[:k].tolist()
