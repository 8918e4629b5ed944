def TokensPrompt(prompt_token_ids):
    return {"prompt_token_ids": prompt_token_ids}
