"""The batched sampler, split by concern:

* :mod:`~hybridserve.sampler.streams` - the random streams of seeded samples;
* :mod:`~hybridserve.sampler.rows` - row preparation: per-row device state kept across
  steps, one staging copy per call;
* :mod:`~hybridserve.sampler.processors` - logit processors (bias, min_tokens bans,
  penalties, temperature, min-p, top-k, top-p) in place on one work buffer;
* :mod:`~hybridserve.sampler.draw` - the draw (exponential race) and logprobs;
* :mod:`~hybridserve.sampler.native` - on the CPU, processors and draw as one native
  kernel call per step (``Sampler(native=True)``; the torch path is its oracle);
* :mod:`~hybridserve.sampler.batch_sampler` - :class:`Sampler`, which ties them together.
"""

from hybridserve.sampler.batch_sampler import Sampler, SamplerOutput
from hybridserve.sampler.rows import SamplingRow
from hybridserve.sampler.streams import SeedStream, counter_uniform, counter_uniform_reference, make_generator

__all__ = [
    "Sampler", "SamplingRow", "SamplerOutput", "SeedStream", "make_generator",
    "counter_uniform", "counter_uniform_reference",
]
