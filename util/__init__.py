"""Small helpers every package may use (they import nothing of kvllm's own)."""
from util.registry import Registry


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for non-negative integers (blocks for a number of slots)."""
    return -(-a // b)


__all__ = ["Registry", "cdiv"]
