export { CryptoPool, type CryptoPoolOptions } from './pool.js';
export { createChunkProcessor, type ChunkReport, type ProcessorDeps } from './processor.js';
export { startWorker, type RunningWorker } from './runner.js';
export { startWebhookWorker, type WebhookWorker, type WebhookWorkerOptions } from './webhook-delivery.js';
