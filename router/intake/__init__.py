"""A client's request made routable: screening, body limits, tenancy, tokenization, block keys."""
