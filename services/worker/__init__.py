"""What the engine-backed services (prefill, decode) share: the model-loading lifecycle around a
servicer (engine_service) and the Admin service with torch trace capture (admin). Imports common and
engine; a process that runs no model never imports this package."""
