export { buildApp, type AppOptions } from './app.js';
export { API_NODE_FLAGS } from './node-flags.js';
export { createApiServices, type ApiServices } from './services.js';
export { answerOnce, IdempotencyStore, type Answer } from './idempotency.js';
export { clientErrorHandler } from './client-errors.js';
export { rateLimitPlugin, type RateLimitOptions } from './plugins/rate-limit.js';
