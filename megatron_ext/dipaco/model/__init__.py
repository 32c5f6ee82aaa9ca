"""What a path is: the levels x modules layout, a path's parameters by module, the worker's
GPTModel of one path, and the base model read from a GPT-trainer checkpoint."""
