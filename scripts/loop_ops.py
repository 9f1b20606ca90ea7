"""The vector instructions of a function's inner loops, from a disassembly: each innermost loop
(a backward jump with no other backward jump inside it) that holds every mnemonic asked for,
with its instruction count, its vector instructions, those that touch the stack (spills and
reloads), and the count of each mnemonic.

    objdump -d --no-show-raw-insn ampc/libampc.so > /tmp/ampc.s
    python scripts/loop_ops.py /tmp/ampc.s ampc_lean_chunk_avx2 vsqrtps,vpmaxud

Divide by the elements one pass of the loop steps (its vsqrtps count times 8 for the lean step's
AVX2 loop) for the count a parameter; docs/internals.md has the lean step's.
"""
import collections
import re
import sys


def main(path, fn, want):
    addr, ins, inside = [], [], False
    for line in open(path).read().splitlines():
        if re.match(r"[0-9a-f]+ <%s>:" % re.escape(fn), line):
            inside = True
            continue
        if inside and re.match(r"[0-9a-f]+ <", line):
            break
        m = re.match(r"\s*([0-9a-f]+):\t(\S+)\s*(.*)", line)
        if inside and m:
            addr.append(int(m.group(1), 16))
            ins.append((m.group(2), m.group(3)))
    back = []
    for k, (op, arg) in enumerate(ins):
        t = re.match(r"([0-9a-f]+) <", arg)
        if op.startswith("j") and t and int(t.group(1), 16) < addr[k] and int(t.group(1), 16) in addr:
            back.append((addr.index(int(t.group(1), 16)), k))
    for s, k in back:
        if any(s <= s2 and k2 < k and (s2, k2) != (s, k) for s2, k2 in back):
            continue        # not innermost
        body = ins[s:k + 1]
        ops = collections.Counter(o for o, _ in body)
        if not all(w in ops for w in want):
            continue
        vec = [b for b in body if b[0].startswith("v")]
        print(f"loop {addr[s]:x}-{addr[k]:x}: {len(body)} instructions, {len(vec)} vector, "
              f"{sum(1 for b in vec if 'rsp' in b[1])} touching the stack; "
              + " ".join(f"{o}:{c}" for o, c in sorted(ops.items(), key=lambda x: -x[1])))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3].split(","))
