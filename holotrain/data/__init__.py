from holotrain.data.corpus import PreparedCorpus, prepare_corpus
from holotrain.data.dataset import TokenBatches

__all__ = ["PreparedCorpus", "prepare_corpus", "TokenBatches"]
