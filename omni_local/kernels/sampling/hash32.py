"""The hash a sampled token's random numbers come from ("lowbias32", from Chris Wellons' hash
prospector): x ^= x >> 16, x *= 0x7FEB352D, x ^= x >> 15, x *= 0x846CA68B, x ^= x >> 16, mod 2**32.

engine/forward/sampling.py's tensor ops and the kernels here (uniform_noise.py, fused_draw.py) take it from
this module, so they hash alike, and a seed draws the same tokens whichever way a row is sampled."""

HASH_SHIFTS = (16, 15, 16)
HASH_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
UNIFORM_BITS = 23  # of a hash, the top ones make a uniform number (engine/forward/sampling.py's `_uniform`)
