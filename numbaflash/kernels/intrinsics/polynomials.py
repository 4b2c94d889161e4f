"""The coefficients of ``ex2_fma``, 2^x on the FMA pipe, shared by its PTX and its emulation.

2^f on [0, 1) as 1 + f (c1 + f (c2 + f c3)), the minimax fit of the relative error with p(0) = 1 fixed, so
an exponent of -127 or less (a hidden score's -inf) gives exactly 0 and an integer gives its power exactly.
Its relative error, float32 Horner steps included, is at most 2^-13.5: under a float16 P's rounding (2^-11),
which the kernels make before P V anyway.
"""

EX2_FMA_COEFFICIENTS = (0.6951168179512024, 0.22764484584331512, 0.07706718146800995)
