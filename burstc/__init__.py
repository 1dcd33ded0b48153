"""burstc: compiler passes over torch.compile graphs for long-sequence causal-LM training."""
from burstc.api import compile, report
from burstc.config import BurstConfig
from burstc.report import Report, RewriteRecord, SkipRecord

__all__ = ["compile", "report", "BurstConfig", "Report", "RewriteRecord", "SkipRecord"]
__version__ = "0.1.0"
