"""The workers the gateway routes to: registration, identity, health, breakers, load, discovery."""
