"""Text data for calibration, fine-tuning and evaluation (see :mod:`prunekit.data.corpus`)."""

from .corpus import (
    CORPUS_MODULES,
    DataError,
    calibration_texts,
    evaluation_texts,
    load_texts,
    stdlib_corpus,
)

__all__ = ["CORPUS_MODULES", "DataError", "calibration_texts", "evaluation_texts", "load_texts", "stdlib_corpus"]
