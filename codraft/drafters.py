"""The draft kinds codraft trains and serves; each is also vLLM's speculative method for it.
(Its own module, free of torch, so that command lines and configs can name them cheaply.)"""

DRAFTERS = ("eagle3", "dflash")
