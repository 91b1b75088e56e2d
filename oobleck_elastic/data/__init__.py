"""Training data from disk: token files and the command that writes them.

    TokenFile                              a map-style dataset over a flat file of token ids
    python -m oobleck_elastic.data.prepare text files + a local HF tokenizer -> a token file

Which sample each step takes is `runtime.data.SampleOrder`'s (Note: [sample order]); this
package only reads samples by index. It imports config and errors, nothing above them.
"""

from oobleck_elastic.data.tokens import TOKEN_DTYPES, TokenFile

__all__ = ["TokenFile", "TOKEN_DTYPES"]
