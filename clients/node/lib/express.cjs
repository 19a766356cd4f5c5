'use strict';
/*
 * The Express adapter (Express 4 and 5, and plain connect/http-style
 * servers): expressIdempotency(options) and the rawBody verify hook.  It
 * finds the raw request body wherever a parser left it (or reads it and puts
 * it back), holds the handler's writes until the engine has stored the
 * response, and then sends what every retry will get.
 */

const { IdempotencyError, MisconfiguredError } = require('./errors.cjs');
const { keyLinesOf } = require('./header.cjs');
const { FRAMING_HEADERS, TOO_LARGE, toBuffer, hasBody } = require('./bodies.cjs');
const { createEngine, THREW, ATTEMPT } = require('./http.cjs');

/*
 * A body parser's verify hook that keeps the raw bytes for the fingerprint:
 * express.json({ verify: rawBody }), express.raw({ type: '*\/*', verify: rawBody }).
 */
function rawBody(req, _res, buf) {
	req.rawBody = Buffer.from(buf);
}

/*
 * Read a request body that no parser has read yet (at most limit + 1 bytes)
 * and put it back: the bytes are unshifted into the stream before it emits
 * 'end', so a body parser mounted after the middleware (express.json(),
 * express.text(), ...) reads the whole body as if nobody had.
 */
function peekBody(req, limit) {
	return new Promise((resolve, reject) => {
		/*
		 * An empty body that ended before anyone listened (an await came
		 * first: a key(req) option, an async middleware) emits no 'readable'
		 * any more: it is empty, and nothing needs to be put back.
		 */
		if (req.complete && req.readableLength === 0) {
			resolve(Buffer.alloc(0));
			return;
		}
		const chunks = [];
		let size = 0;
		const finish = (value, err) => {
			req.off('readable', onReadable);
			req.off('end', onEnd);
			req.off('error', onError);
			req.off('close', onClose);
			if (err)
				reject(err);
			else
				resolve(value);
		};
		function onReadable() {
			while (req.readableLength > 0) {
				/* an exact length: reading the last byte with read() would schedule 'end' */
				const chunk = req.read(req.readableLength);
				if (chunk === null)
					break;
				const buf = Buffer.isBuffer(chunk) ? chunk : Buffer.from(chunk);
				chunks.push(buf);
				size += buf.length;
				if (size > limit)
					return finish(TOO_LARGE);
			}
			if (req.complete && req.readableLength === 0) {
				const body = Buffer.concat(chunks);
				if (body.length > 0)
					req.unshift(body);
				finish(body);
			}
		}
		/* the stream ended under us: what was read is the body, nothing is left to put back */
		function onEnd() {
			finish(Buffer.concat(chunks));
		}
		function onError(err) {
			finish(undefined, err);
		}
		function onClose() {
			if (!req.complete)
				finish(undefined, new IdempotencyError('the request was aborted while its body was read'));
		}
		req.on('readable', onReadable);
		req.on('end', onEnd);
		req.on('error', onError);
		req.on('close', onClose);
	});
}

/* the raw request body of a Node request, wherever a parser left it */
async function expressRawBody(req, limit) {
	let body = null;
	if (Buffer.isBuffer(req.rawBody))
		body = req.rawBody;
	else if (typeof req.rawBody === 'string')
		body = Buffer.from(req.rawBody);
	else if (Buffer.isBuffer(req.body))
		body = req.body;
	if (body !== null)
		return body.length > limit ? TOO_LARGE : body;
	if (req.complete && !req.readable)
		throw new MisconfiguredError('A body parser read the request body before the idempotency ' +
			'middleware without keeping its bytes, which the fingerprint needs: pass ' +
			'{ verify: rawBody } to the body parser (express.json({ verify: rawBody })), or mount ' +
			'the middleware before the parser.');
	body = await peekBody(req, limit);
	if (body !== TOO_LARGE)
		req.rawBody = body;
	return body;
}

/* write a whole response on a Node ServerResponse, with its own framing */
function sendNode(res, response, original = res) {
	res.statusCode = response.status;
	for (const [name, value] of Object.entries(response.headers))
		if (!FRAMING_HEADERS.has(name.toLowerCase()))
			res.setHeader(name, value);
	for (const name of FRAMING_HEADERS)
		res.removeHeader(name);
	if (hasBody(response.status)) {
		res.setHeader('content-length', String(response.body.length));
		original.end.call(res, response.body);
	} else {
		original.end.call(res);
	}
}

/*
 * After a 504 went out, the late handler still writes its response: into
 * these headers of its own, which complete() stores, instead of the
 * response already sent.
 */
function detachHeaders(res, initial) {
	const headers = new Map(Object.entries(initial).map(([n, v]) => [n.toLowerCase(), v]));
	res.setHeader = (name, value) => {
		headers.set(String(name).toLowerCase(), value);
		return res;
	};
	res.appendHeader = (name, value) => {
		const n = String(name).toLowerCase();
		const old = headers.get(n);
		headers.set(n, old === undefined ? value : [].concat(old, value));
		return res;
	};
	res.getHeader = (name) => headers.get(String(name).toLowerCase());
	res.getHeaders = () => Object.fromEntries(headers);
	res.getHeaderNames = () => [...headers.keys()];
	res.hasHeader = (name) => headers.has(String(name).toLowerCase());
	res.removeHeader = (name) => { headers.delete(String(name).toLowerCase()); };
}

/*
 * expressIdempotency(options): middleware for Express 4 and 5 (and plain
 * connect/http style servers).  The route's handler answers as usual
 * (res.status().json(), res.send(buffer), a stream...); the middleware holds
 * the response back until it is stored, then sends what retries will get.
 * The handler finds the key, token, attempt, and in transactional mode the pg
 * client, on req.idempotency.
 */
function expressIdempotency(options) {
	const engine = createEngine(options);

	function make(transactional) {
		return async function pgIdempotency(req, res, next) {
			try {
				await handle(req, res, next, transactional);
			} catch (err) {
				next(err);
			}
		};
	}

	async function handle(req, res, next, transactional) {
		let onTimeout = null;
		const started = await engine.begin({
			method: req.method,
			path: req.originalUrl ?? req.url,
			keyLines: keyLinesOf(req.headers, req.headersDistinct),
			contentLength: req.headers['content-length'],
			contentType: req.headers['content-type'],
			rawBody: (limit) => expressRawBody(req, limit),
			onTimeout: (response) => onTimeout?.(response),
			original: req,
		}, { transactional });
		if (started.action === 'pass')
			return next();
		if (started.action === 'respond')
			return sendNode(res, started.response);

		const { context, complete } = started;
		req.idempotency = context;
		req[ATTEMPT] = started;
		const original = { writeHead: res.writeHead, write: res.write, end: res.end };
		const chunks = [];
		let ended = false;
		res.setHeader('idempotency-key-retention', engine.retentionHeader);
		const restore = () => {
			res.writeHead = original.writeHead;
			res.write = original.write;
			res.end = original.end;
		};

		onTimeout = (response) => {
			if (res.headersSent)
				return;
			const handlerStatus = res.statusCode;
			const handlerHeaders = res.getHeaders();
			const held = { writeHead: res.writeHead, write: res.write, end: res.end };
			for (const name of res.getHeaderNames())
				res.removeHeader(name);
			restore();
			sendNode(res, response, original);
			Object.assign(res, held);
			detachHeaders(res, handlerHeaders);
			res.statusCode = handlerStatus;
		};

		/* the handler's writes are held until the result is stored */
		res.writeHead = function writeHead(statusCode, reason, headers) {
			if (typeof reason !== 'string') {
				headers = reason;
				reason = undefined;
			}
			res.statusCode = statusCode;
			if (reason)
				res.statusMessage = reason;
			if (Array.isArray(headers)) {
				for (let i = 0; i + 1 < headers.length; i += 2)
					res.setHeader(headers[i], headers[i + 1]);
			} else if (headers) {
				for (const [name, value] of Object.entries(headers))
					res.setHeader(name, value);
			}
			return res;
		};
		res.write = function write(chunk, encoding, callback) {
			if (typeof encoding === 'function')
				[callback, encoding] = [encoding, undefined];
			const buf = toBuffer(chunk, encoding);
			if (buf)
				chunks.push(buf);
			if (callback)
				process.nextTick(callback);
			return true;
		};
		res.end = function end(chunk, encoding, callback) {
			if (typeof chunk === 'function')
				[callback, chunk] = [chunk, undefined];
			else if (typeof encoding === 'function')
				[callback, encoding] = [encoding, undefined];
			if (ended)
				return res;
			ended = true;
			const buf = toBuffer(chunk, encoding);
			if (buf)
				chunks.push(buf);
			if (callback)
				res.once('finish', callback);
			complete({
				status: res.statusCode, headers: res.getHeaders(), body: Buffer.concat(chunks),
				threw: req[THREW] !== undefined,
			})
				.then((answer) => {
					if (answer === null || res.headersSent)
						return;            /* the 504 was the answer */
					restore();
					for (const name of res.getHeaderNames())
						if (!(name in answer.headers))
							res.removeHeader(name);
					sendNode(res, answer, original);
				}, (err) => {
					restore();
					next(err);
				});
			return res;
		};
		return next();
	}

	const middleware = make(false);
	middleware.transactional = make(true);
	middleware.cache = engine.cache;
	/*
	 * Error middleware to mount after the routes: Express gives a
	 * middleware no other way to tell a thrown error from a 5xx the handler
	 * sends, and a thrown error releases the key even with storeServerErrors.
	 */
	middleware.errors = function pgIdempotencyErrors(err, req, res, next) {
		const started = req[ATTEMPT];
		if (started && !res.headersSent) {
			req[THREW] = err ?? new Error('the handler failed');
		} else if (started?.timedOut) {
			/* the 504 went out and the handler threw later: its attempt ends here, key released */
			started.abandon(err ?? new Error('the handler failed after its timeout')).catch(() => {});
		}
		next(err);
	};
	return middleware;
}

module.exports = { expressIdempotency, rawBody };
