"""What every HTTP process shares: the OpenAI front end, protocol, typed errors, auth (public and
internal), tenancy, drain and metrics. Torch-free; never imports router/ or worker/."""
