"""Training text: the Python standard library's own .py sources (every machine with Python has them).

Files: every `*.py` under the running interpreter's stdlib directory (sysconfig 'stdlib'), site-/dist-packages
excluded, sorted by relative path. Split: a file is held out when the first byte of sha1(relative path) < 6
(~2.3%, stable across Python versions and file lists). Chat samples: for each function with a docstring, the
docstring's first line as the user turn and the function's source as the assistant turn, rendered as the K2.6
chat template renders one user message with thinking=false (tools/kdtree-text/assets/chat_template.jinja).
"""
import ast
import hashlib
import os
import sysconfig
import textwrap


def stdlib_files():
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        for f in files:
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(d, f), root))
    return root, sorted(out)


def held_out(rel):
    return hashlib.sha1(rel.encode()).digest()[0] < 6


def read(root, rel):
    with open(os.path.join(root, rel), "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def chat_text(question, answer):
    """One user turn + generation prompt (thinking=false) + the assistant's answer and <|im_end|>."""
    return (f"<|im_user|>user<|im_middle|>{question}<|im_end|>"
            f"<|im_assistant|>assistant<|im_middle|><think></think>{answer}<|im_end|>")


def chat_prompt(question):
    return f"<|im_user|>user<|im_middle|>{question}<|im_end|><|im_assistant|>assistant<|im_middle|><think></think>"


def functions_with_docstrings(text, max_chars=1500):
    """(docstring first line, dedented function source) for each function of a module (skips unparsable)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or not doc.strip():
            continue
        q = doc.strip().splitlines()[0].strip()
        if not (10 <= len(q) <= 120) or "<|" in q:
            continue
        src = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno]))
        if len(src) > max_chars or "<|" in src:
            continue
        out.append((q, src))
    return out
