export { freePort, redisAnswers, waitForRedis } from '../../scripts/local-net.js';
