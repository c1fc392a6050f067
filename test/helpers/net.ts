export { freePort, portIsFree, redisAnswers, waitForRedis } from '../../scripts/local-net.js';
