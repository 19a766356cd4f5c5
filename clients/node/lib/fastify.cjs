'use strict';
/*
 * The Fastify 5 adapter: fastifyIdempotency, a plugin that needs no
 * fastify-plugin wrapper.  Its hooks keep the raw request bytes for the
 * fingerprint (preParsing), claim the key after validation (preHandler),
 * store the reply before it goes out (onSend) and give the key back when a
 * request ends without a reply (onResponse).
 */

const { Transform } = require('node:stream');
const { keyLinesOf } = require('./header.cjs');
const { FRAMING_HEADERS, bodyLimit, TOO_LARGE, toBuffer, hasBody } = require('./bodies.cjs');
const { createEngine, THREW, ATTEMPT } = require('./http.cjs');
const { rememberSeconds, keepRequestOption } = require('./core.cjs');

const RAW_BODY = Symbol.for('pg-idempotency.rawBody');
const BODY_TOO_LARGE = Symbol('pg-idempotency.bodyTooLarge');

/* the whole of a reply payload sent as a stream */
function readStream(stream) {
	return new Promise((resolve, reject) => {
		const chunks = [];
		stream.on('data', (c) => chunks.push(Buffer.isBuffer(c) ? c : Buffer.from(c)));
		stream.on('end', () => resolve(Buffer.concat(chunks)));
		stream.on('error', reject);
	});
}

/*
 * fastifyIdempotency: a Fastify 5 plugin.  It covers every route of the
 * methods option in the context it is registered in (and, with skip-override,
 * that context is the parent's).  Per route: config: { idempotency: false }
 * turns it off, config: { idempotency: { transactional: true } } runs the
 * route in one transaction on request.idempotency.client, and
 * config: { idempotency: { remember: seconds } } replaces the remember option
 * for the route, and config: { idempotency: { keepRequest: boolean } } the
 * keepRequest option.
 */
async function fastifyIdempotency(fastify, options) {
	const engine = createEngine(options);
	const methods = new Set((options.methods ?? ['POST', 'PATCH']).map((m) => m.toUpperCase()));
	const maxBodySize = bodyLimit(options.maxBodySize);

	if (!fastify.hasRequestDecorator('idempotency'))
		fastify.decorateRequest('idempotency', null);

	const routeSetting = (request) => request.routeOptions?.config?.idempotency;

	/* a route's own remember and keepRequest are checked when the route is added, not at its first request */
	fastify.addHook('onRoute', (route) => {
		const remember = route.config?.idempotency?.remember;
		if (remember !== undefined)
			rememberSeconds(remember);
		const keepRequest = route.config?.idempotency?.keepRequest;
		if (keepRequest !== undefined)
			keepRequestOption(keepRequest);
	});

	/* keep the raw bytes for the fingerprint (at most maxBodySize + 1), whatever the content type parser does */
	fastify.addHook('preParsing', async (request, reply, payload) => {
		if (!methods.has(request.method) || routeSetting(request) === false)
			return payload;
		const chunks = [];
		let size = 0;
		const tee = new Transform({
			transform(chunk, encoding, callback) {
				const buf = Buffer.isBuffer(chunk) ? chunk : Buffer.from(chunk, encoding);
				size += buf.length;
				if (size > maxBodySize)
					request[BODY_TOO_LARGE] = true;
				else
					chunks.push(buf);
				tee.receivedEncodedLength = payload.receivedEncodedLength;
				callback(null, chunk);
			},
			flush(callback) {
				request[RAW_BODY] = request[BODY_TOO_LARGE] ? TOO_LARGE : Buffer.concat(chunks);
				callback();
			},
		});
		payload.on('error', (err) => tee.destroy(err));
		return payload.pipe(tee);
	});

	/* a thrown error releases the key, whatever status the error handler answers */
	fastify.addHook('onError', async (request, reply, error) => {
		if (request[ATTEMPT])
			request[THREW] = error;
	});

	/* after validation, so that a request refused by its schema does not use up its key */
	fastify.addHook('preHandler', async (request, reply) => {
		const setting = routeSetting(request);
		if (setting === false)
			return;
		let onTimeout = null;
		const started = await engine.begin({
			method: request.method,
			path: request.raw.url,
			keyLines: keyLinesOf(request.headers, request.raw.headersDistinct),
			contentLength: request.headers['content-length'],
			contentType: request.headers['content-type'],
			rawBody: async () => (request[BODY_TOO_LARGE] ? TOO_LARGE : request[RAW_BODY] ?? Buffer.alloc(0)),
			onTimeout: (response) => onTimeout?.(response),
			original: request,
		}, {
			transactional: setting?.transactional === true,
			remember: setting?.remember,
			keepRequest: setting?.keepRequest,
		});
		if (started.action === 'pass')
			return;
		if (started.action === 'respond') {
			const { status, headers, body } = started.response;
			reply.code(status).headers(headers);
			/* an empty body goes as no payload, which Fastify gives no content type of its own */
			return reply.send(hasBody(status) && body.length > 0 ? body : undefined);
		}
		request.idempotency = started.context;
		request[ATTEMPT] = started;
		reply.header('idempotency-key-retention', engine.retentionHeader);
		/*
		 * Past handlerTimeout the 504 goes out now; the late handler's answer
		 * (returned or sent) reaches the replaced send() and is completed, not sent.
		 */
		onTimeout = (response) => {
			if (reply.sent || request[ATTEMPT] !== started)
				return;
			request[ATTEMPT] = null;
			const send = reply.send;
			const handlerHeaders = reply.getHeaders();
			const handlerStatus = reply.statusCode;
			for (const name of Object.keys(handlerHeaders))
				reply.removeHeader(name);
			reply.code(response.status).headers(response.headers);
			reply.header('content-length', String(response.body.length));
			send.call(reply, response.body);
			let late = false;
			reply.send = function lateSend(payload) {
				/* `return reply.send(x)` hands the reply itself back: x was taken already */
				if (late || payload === reply)
					return reply;
				late = true;
				let body;
				let headers = { ...handlerHeaders };
				if (payload === null || payload === undefined)
					body = Buffer.alloc(0);
				else if (Buffer.isBuffer(payload) || typeof payload === 'string')
					body = toBuffer(payload);
				else {
					body = Buffer.from(JSON.stringify(payload));
					headers = { 'content-type': 'application/json; charset=utf-8', ...headers };
				}
				const status = reply.statusCode === response.status ? handlerStatus : reply.statusCode;
				started.complete({ status, headers, body, threw: payload instanceof Error })
					.catch((err) => request.log.error(err));
				return reply;
			};
		};
	});

	fastify.addHook('onSend', async (request, reply, payload) => {
		const started = request[ATTEMPT];
		if (!started)
			return payload;
		request[ATTEMPT] = null;
		let body;
		if (payload === null || payload === undefined)
			body = Buffer.alloc(0);
		else if (typeof payload.pipe === 'function')
			body = await readStream(payload);
		else
			body = toBuffer(payload);
		const response = await started.complete({
			status: reply.statusCode, headers: reply.getHeaders(), body,
			threw: request[THREW] !== undefined,
		});
		reply.code(response.status);
		for (const name of Object.keys(reply.getHeaders()))
			if (!(name in response.headers))
				reply.removeHeader(name);
		reply.headers(response.headers);
		for (const name of FRAMING_HEADERS)
			reply.removeHeader(name);
		if (!hasBody(response.status)) {
			reply.removeHeader('content-length');
			return null;
		}
		reply.header('content-length', String(response.body.length));
		return response.body;
	});

	/* a request that ends without a reply (e.g. hijacked) gives its key back */
	fastify.addHook('onResponse', async (request) => {
		const started = request[ATTEMPT];
		if (started) {
			request[ATTEMPT] = null;
			await started.abandon(new Error('the request ended without a reply'));
		}
	});
}
/* the plugin applies to the context it is registered in, with no fastify-plugin */
fastifyIdempotency[Symbol.for('skip-override')] = true;
fastifyIdempotency[Symbol.for('fastify.display-name')] = 'pg-idempotency';
fastifyIdempotency[Symbol.for('plugin-meta')] = { name: 'pg-idempotency', fastify: '>=5' };

module.exports = { fastifyIdempotency };
