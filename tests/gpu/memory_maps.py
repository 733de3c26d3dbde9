"""What Linux's /proc/self/smaps says of the mapping holding an address."""

from __future__ import annotations


def mapping_of(address: int) -> tuple[str, set[str], tuple[int, int]]:
    """The permissions, VmFlags and address range of this process's mapping holding `address`."""
    perms, span, inside = None, None, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            low, high = (int(part, 16) for part in head[0].split("-"))
            inside = low <= address < high
            if inside:
                perms, span = head[1], (low, high)
        elif inside and head[0] == "VmFlags:":
            return perms, set(head[1:]), span
    raise AssertionError(f"no mapping holds {address:#x}")
