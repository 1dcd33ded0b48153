"""burstc: compiler passes over torch.compile graphs for long-sequence causal-LM training."""
from burstc.api import compile, report
from burstc.config import BurstConfig
from burstc.errors import MeshError, PeerFailure, PeerTimeout
from burstc.explain import explain  # the function; the module is sys.modules["burstc.explain"]
from burstc.ops.ring_attention import ring_attention, ring_attention_with_lse
from burstc.report import Report, RewriteRecord, SkipRecord
from burstc.timeline import trace

__all__ = ["compile", "report", "explain", "BurstConfig", "MeshError", "PeerFailure", "PeerTimeout", "Report", "RewriteRecord",
           "SkipRecord", "ring_attention", "ring_attention_with_lse", "trace"]
__version__ = "0.1.0"
