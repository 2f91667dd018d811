"""Caps on what one HTTP request may ask for, so no request can make the server do unbounded work."""

MAX_N = 16  # OpenAI `n`: choices per prompt
MAX_PROMPTS = 64  # prompts in one completions or /generate batch
MAX_REQUESTS = 128  # engine requests behind one HTTP request (prompts x n)
MAX_STOP = 16  # stop strings
MAX_STOP_LEN = 256  # characters of one stop string
MAX_TOKEN_ID_LIST = 256  # stop_token_ids, token_ids_logprob
MAX_TOP_LOGPROBS = 20  # OpenAI `logprobs` / `top_logprobs`
MAX_NATIVE_TOP_LOGPROBS = 256  # native `top_logprobs_num`
