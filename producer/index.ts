export { buildApp, type AppOptions } from './app.js';
export { API_NODE_FLAGS } from './node-flags.js';
export { createApiServices, type ApiServices } from './services.js';
