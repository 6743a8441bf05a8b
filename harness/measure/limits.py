"""The suite's limits on what one verify forward and one KV cache hold: the argument parsers (analysis/numbers.py)
refuse past them and the reader of result files (result_cases.py) leaves a case past them out."""

TOKEN_COUNT_MAX = 64  # the largest token count any --tokens takes (tokens per verify), so the largest accept length
FORWARD_ROWS_MAX = TOKEN_COUNT_MAX  # B requests x D tokens in one verify forward (what SGLang captures per batch size)
MAX_CONTEXT = 1 << 20  # tokens in the KV cache; K2.5's window is 262144
