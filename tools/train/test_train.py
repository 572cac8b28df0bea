"""Self-tests of the training tools (run: python3 tools/train/test_train.py; needs regex, and torch + safetensors
+ tiktoken for the quantiser / round-trip cases, which are skipped without them). Not part of CI (no torch there).

* bpe.pretokenize on the cases of tools/kdtree-text/src/tokenizer.rs `kimi_pattern_splits_tricky_text`;
* bpe.train: deterministic, distinct token bytes, single bytes first, and tiktoken round-trips text;
* export.quantize_int4 bit-exact against the compressed-tensors fixture (tools/kdtree-convert/fixtures/ct_int4),
  and dequantize_int4 inverts the packing.
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bpe  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kdtree-convert", "fixtures", "ct_int4")

try:
    import torch  # noqa: F401
    import safetensors  # noqa: F401
    import tiktoken  # noqa: F401
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False


class Tokenizer(unittest.TestCase):
    def test_split_matches_kdtree_text(self):
        cases = [("Hello world", ["Hello", " world"]), ("I'm they'RE don't", ["I'm", " they'RE", " don't"]),
                 ("12345 -7", ["123", "45", " -", "7"]), ("你好世界abc", ["你好世界", "abc"]),
                 ("東京タワー", ["東京", "タワー"]), ("HTTPServer", ["HTTPServer"]),
                 ("a  \n\n  b", ["a", "  \n\n", " ", " b"]), ("x   y", ["x", "  ", " y"]),
                 ("end.\n\nNext", ["end", ".\n\n", "Next"]), ("tab\t\t", ["tab", "\t\t"]), ("(café)", ["(café", ")"])]
        for text, want in cases:
            self.assertEqual(bpe.pretokenize(text), want, text)

    def test_train_is_deterministic_and_distinct(self):
        text = "def foo(self):\n    return self.foo + self.bar\n" * 50 + "class Bar:\n    pass\n" * 20
        a = bpe.train(bpe.count_pieces([text]), 300)
        b = bpe.train(bpe.count_pieces([text]), 300)
        self.assertEqual(a, b)
        self.assertEqual(a[:256], [bytes([i]) for i in range(256)])
        self.assertEqual(len(set(a)), len(a))
        self.assertIn(b" self", a)
        if HAVE_TORCH:
            enc = bpe.tiktoken_encoding(a)
            ids = enc.encode(text + "<|im_end|>", allowed_special="all")
            self.assertEqual(ids[-1], len(a) + bpe.IM_END)
            self.assertEqual(enc.decode(ids), text + "<|im_end|>")


@unittest.skipUnless(HAVE_TORCH, "needs torch, safetensors, tiktoken")
class Quantiser(unittest.TestCase):
    def test_bit_exact_with_compressed_tensors(self):
        import torch
        from safetensors.torch import load_file
        import export
        src = load_file(os.path.join(FIXTURE, "source.safetensors"))
        ref = load_file(os.path.join(FIXTURE, "compressed.safetensors"))
        for name in ["a", "b", "edge"]:
            w = src[name + ".weight"]
            packed, scale = export.quantize_int4(w.float())
            self.assertTrue(torch.equal(packed, ref[name + ".weight_packed"]), name)
            self.assertTrue(torch.equal(scale.view(torch.int16), ref[name + ".weight_scale"].view(torch.int16)), name)
            deq = export.dequantize_int4(packed, scale, w.shape[1])
            q = (deq / scale.float().repeat_interleave(32, 1))
            self.assertTrue(torch.equal(q, q.round()) and q.min() >= -8 and q.max() <= 7, name)


if __name__ == "__main__":
    unittest.main()
