"""Caps on what one HTTP request may ask for, so no request can make the server do unbounded work.

Each is enforced with a 400 naming the field (the body size with a 413); `docs/reliability.md` lists
them with the test of each. Prompt length and `max_tokens` are bounded by the served context
(`max_model_len`), checked by the engine at admission.
"""

MAX_BODY_BYTES = 16 * 2**20  # default request body cap (ServeConfig.max_body_bytes); bigger: 413

MAX_N = 16  # OpenAI `n`: choices per prompt
MAX_PROMPTS = 64  # prompts in one completions or /generate batch
MAX_REQUESTS = 128  # engine requests behind one HTTP request (prompts x n)
MAX_STOP = 16  # stop strings
MAX_STOP_LEN = 256  # characters of one stop string
MAX_TOKEN_ID_LIST = 256  # stop_token_ids, token_ids_logprob
MAX_TOP_LOGPROBS = 20  # OpenAI `logprobs` / `top_logprobs`
MAX_NATIVE_TOP_LOGPROBS = 256  # native `top_logprobs_num`
MAX_RID_LEN = 256  # characters of a native request id (`rid`)
