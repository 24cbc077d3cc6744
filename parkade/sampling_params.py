"""`parkade.sampling_params`, shaped like `vllm.sampling_params`, so that
`from vllm.sampling_params import SamplingParams, BeamSearchParams, RequestOutputKind` runs with
only the package name changed. Torch-free, as `parkade` itself."""

from parkade.engine.beam_search import BeamSearchParams
from parkade.schemas.sampling import RequestOutputKind, SamplingParams

__all__ = ["BeamSearchParams", "RequestOutputKind", "SamplingParams"]
