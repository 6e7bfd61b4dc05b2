"""The draft kinds codraft trains and serves; each is also vLLM's speculative method for it.
(Its own module, free of torch, so that command lines and configs can name them cheaply.)"""

DRAFTERS = ("eagle3", "dflash", "dspark")  # what codraft trains and checks
# what `codraft serve` serves: vLLM serves DSpark only in its V2 model runner, which needs
# Triton (CUDA builds), and codraft's capture and swaps are not built for it yet
SERVED_DRAFTERS = ("eagle3", "dflash")
