"""The coefficients of ``ex2_fma`` and ``ex2_fma_f16x2``, 2^x on the FMA pipe, shared by their PTX and emulations.

``ex2_fma``: 2^f on [0, 1) as 1 + f (c1 + f (c2 + f c3)), the minimax fit of the relative error with p(0) = 1
fixed, so an exponent of -127 or less (a hidden score's -inf) gives exactly 0 and an integer gives its power
exactly. Its relative error, float32 Horner steps included, is at most 2^-13.5: under a float16 P's rounding
(2^-11), which the kernels make before P V anyway.
"""

EX2_FMA_COEFFICIENTS = (0.6951168179512024, 0.22764484584331512, 0.07706718146800995)

# ``ex2_fma_f16x2``: 2^-7 2^f on [-1/2, 1/2] as c0 + f (c1 + f (c2 + f c3)) in float16 Horner steps (HFMA2), the
# minimax fit of the relative error with each coefficient rounded to float16 (c0 is 2^-7 exactly). The 2^-7 lets
# the exponent's factor 2^(j + 7) stay a normal float16 down to j = -21, so P keeps float16's subnormals as a
# rounded float32 P does. The relative error, every float16 rounding included, is at most 2^-10.8 on every
# float16 f in [-1/2, 1/2] (mean 2^-12.6), against float16's own rounding of P, 2^-11.
EX2_FMA_F16X2_COEFFICIENTS = (0.0078125, 0.0054168701171875, 0.0018949508666992188, 0.000431060791015625)
# Its exponents are clamped at EX2_FMA_F16X2_FLOOR, whose power is 0 (the exponent field 0), and split by adding
# EX2_FMA_F16X2_MAGIC, 1.5 x 2^10 - EX2_FMA_F16X2_FLOOR: the sum's low mantissa bits hold round(x) - FLOOR, the
# exponent field of 2^(round(x) + 7).
EX2_FMA_F16X2_FLOOR = -22
EX2_FMA_F16X2_MAGIC = 1536 - EX2_FMA_F16X2_FLOOR
